package admin

import (
	"strings"
	"testing"
)

func TestDecodeActionIsStrict(t *testing.T) {
	for _, c := range []struct{ body, action, err string }{
		{`{"action":"open"}`, "open", ""},
		{" {\"action\" : \"close\"}\n\t ", "close", ""},
		{`{"action":"open"}{"action":"close"}`, "", "trailing data"},
		{`{"action":"open"} x`, "", "trailing data"},
		{`{"Action":"open"}`, "", `unknown field "Action"`},
		{`{"ACTION":"open"}`, "", `unknown field "ACTION"`},
		{`{"action":"open","action":"close"}`, "", "given twice"},
		{`{"action":"open","verb":"x"}`, "", `unknown field "verb"`},
		{`{"action":1}`, "", "must be a string"},
		{`{"action":{"x":1}}`, "", "must be a string"},
		{`{"action":null}`, "", "must be a string"},
		{`{}`, "", `no "action"`},
		{`[]`, "", "not a JSON object"},
		{`"open"`, "", "not a JSON object"},
		{``, "", "EOF"},
		{`{"action":"open"`, "", "EOF"},
		{`{"action":"open",}`, "", "invalid character"},
		{`{"` + strings.Repeat("k", 3000) + `":1}`, "", "(3000 bytes)"},
	} {
		got, err := decodeAction(strings.NewReader(c.body))
		if c.err == "" {
			if err != nil || got != c.action {
				t.Errorf("%q: %q %v, want %q", c.body, got, err, c.action)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%q: %q %v, want an error with %q", c.body, got, err, c.err)
		}
		if err != nil && len(err.Error()) > 200 {
			t.Errorf("%q: error of %d bytes", c.body[:min(len(c.body), 40)], len(err.Error()))
		}
	}
}

func TestQuoteIsBounded(t *testing.T) {
	if q := Quote("a?b"); q != `"a?b"` {
		t.Fatalf("short: %s", q)
	}
	q := Quote(strings.Repeat("é", 500000))
	if len(q) > maxQuoted+40 || !strings.Contains(q, "(1000000 bytes)") || !strings.HasPrefix(q, `"éé`) {
		t.Fatalf("long: %s", q)
	}
}
