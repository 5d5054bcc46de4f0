// Command breakerctl looks at and steers breakerd.
//
//	breakerctl config validate FILE     every problem with its key path; exit 1 if any
//	breakerctl status [-o json]          circuits, from the daemon
//	breakerctl events [-o json]          recent transitions, from the daemon
//	breakerctl top [--interval 2s]       circuits live in the terminal (keys: s f r n sort, q quits)
//	breakerctl inspect [-o json]         the pinned maps, read directly (daemon or not)
//	breakerctl force open|close|release|reset NAME
//
// Exit codes: 0 success, 1 the operation failed (invalid file, daemon
// error), 2 bad usage.
package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"

	"github.com/breakerd/breakerd/api"
	"github.com/breakerd/breakerd/maps"
	"github.com/breakerd/breakerd/policy"
)

type usageError struct{ msg string }

func (u usageError) Error() string { return u.msg }

func main() {
	err := run(os.Args[1:], os.Stdout)
	var ue usageError
	switch {
	case err == nil:
	case errors.As(err, &ue):
		fmt.Fprintln(os.Stderr, "breakerctl:", err)
		fmt.Fprintln(os.Stderr, usageLine)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "breakerctl:", err)
		os.Exit(1)
	}
}

const usageLine = "usage: breakerctl config validate FILE | status | events | top | inspect | force open|close|release|reset NAME  [-o json] [--socket PATH | --addr HOST:PORT] [--bpffs DIR] [--interval D]"

type client struct {
	http  *http.Client
	base  string
	token string // sent as a bearer token when set (--token-file)
}

func run(args []string, out io.Writer) error {
	fs := pflag.NewFlagSet("breakerctl", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	output := fs.StringP("output", "o", "text", "text or json")
	socket := fs.String("socket", "/run/breakerd/admin.sock", "the daemon's admin unix socket")
	addr := fs.String("addr", "", "the daemon's admin TCP address instead of the socket (changes, and circuits and events from a non-loopback address, need --token-file)")
	tokenFile := fs.String("token-file", "", "file with the bearer token for --addr")
	bpffs := fs.String("bpffs", maps.DefaultDir, "bpffs directory of the pins (inspect)")
	interval := fs.Duration("interval", 2*time.Second, "how often top reads the daemon")
	if err := fs.Parse(args); errors.Is(err, pflag.ErrHelp) {
		fmt.Fprintf(out, "breakerctl looks at and steers breakerd.\n\n%s\n\nexit status: 0 success, 1 failure, 2 bad usage\n\nflags:\n%s", usageLine, fs.FlagUsages())
		return nil
	} else if err != nil {
		return usageError{err.Error()}
	}
	if *output != "text" && *output != "json" {
		return usageError{fmt.Sprintf("-o %q is not text or json", *output)}
	}
	asJSON := *output == "json"
	a := fs.Args()
	if len(a) == 0 {
		return usageError{"no command"}
	}
	c := &client{base: "http://breakerd"}
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			return fmt.Errorf("reading token: %w", err)
		}
		c.token = strings.TrimSpace(string(b))
	}
	if *addr != "" {
		c.http, c.base = &http.Client{Timeout: 10 * time.Second}, "http://"+*addr
	} else {
		path := *socket
		c.http = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		}}}
	}
	switch a[0] {
	case "config":
		if len(a) != 3 || a[1] != "validate" {
			return usageError{"config validate FILE"}
		}
		return validate(a[2], out)
	case "status":
		if len(a) != 1 {
			return usageError{fmt.Sprintf("status takes no argument (got %q)", a[1])}
		}
		cs, err := c.circuits()
		if err != nil {
			return err
		}
		if asJSON {
			return writeJSON(out, cs)
		}
		tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tTARGET\tWORKLOAD\tSTATE\tFAILURE\tSLOW\tCALLS\tOPEN FOR\tREJECTED\tCONNS\tBULKHEAD REJECTED\tFAILED PODS\tREJECTED PODS")
		for _, ci := range cs {
			open := "-"
			if !ci.OpenUntil.IsZero() {
				open = time.Until(ci.OpenUntil).Round(time.Second).String()
			}
			conns := "-"
			if s, ok := bulkheadOf(ci, "max_connections"); ok {
				conns = s
			}
			pods := "-"
			if len(ci.FailedPods) > 0 {
				pods = strings.Join(ci.FailedPods, ",")
			}
			rejected := rejectedBy(ci)
			if rejected == "" {
				rejected = "-"
			}
			state := ci.State
			if ci.FleetNodes > 0 {
				state += fmt.Sprintf(" (open by the fleet: %d nodes)", ci.FleetNodes)
			}
			if ci.SlowStart != nil {
				state += fmt.Sprintf(" (ramping: %.0f%% admitted)", 100*ci.SlowStart.Share)
			}
			if ci.Redirected > 0 {
				state += fmt.Sprintf(" (to fallback %s: %d)", ci.Fallback, ci.Redirected)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.0f%%\t%.0f%%\t%d\t%s\t%d\t%s\t%d\t%s\t%s\n", ci.Name, ci.Target, ci.Workload, state, 100*ci.FailureRate, 100*ci.SlowRate, ci.Calls, open, ci.Rejected, conns, ci.BulkheadRejected, pods, rejected)
		}
		return tw.Flush()
	case "events":
		if len(a) != 1 {
			return usageError{fmt.Sprintf("events takes no argument (got %q)", a[1])}
		}
		var evs []api.TransitionEvent
		if err := c.get("/v1/events", &evs); err != nil {
			return err
		}
		if asJSON {
			return writeJSON(out, evs)
		}
		tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "TIME\tCIRCUIT\tFROM\tTO\tREASON\tFAILURE\tSLOW")
		for _, e := range evs {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%.0f%%\t%.0f%%\n", e.Time.Format(time.TimeOnly), e.Circuit, e.From, e.To, e.Reason, 100*e.FailureRate, 100*e.SlowRate)
		}
		return tw.Flush()
	case "top":
		if len(a) != 1 {
			return usageError{fmt.Sprintf("top takes no argument (got %q)", a[1])}
		}
		if asJSON {
			return usageError{"top has no json output (use status -o json)"}
		}
		return top(c, *interval)
	case "force":
		if len(a) != 3 {
			return usageError{"force open|close|release|reset NAME"}
		}
		switch a[1] {
		case "open", "close", "release", "reset":
		default:
			return usageError{fmt.Sprintf("force %q: the action is open, close, release or reset", a[1])}
		}
		var ci api.CircuitInfo
		if err := c.post("/v1/circuits/"+url.PathEscape(a[2]), map[string]string{"action": a[1]}, &ci); err != nil {
			return err
		}
		if asJSON {
			return writeJSON(out, ci)
		}
		fmt.Fprintf(out, "%s is now %s\n", ci.Name, ci.State)
		return nil
	case "inspect":
		if len(a) != 1 {
			return usageError{fmt.Sprintf("inspect takes no argument (got %q)", a[1])}
		}
		return inspect(*bpffs, asJSON, out)
	}
	return usageError{fmt.Sprintf("unknown command %q", a[0])}
}

func validate(path string, out io.Writer) error {
	cfg, err := policy.LoadFile(path)
	if err != nil {
		var ve *policy.ValidationError
		if errors.As(err, &ve) {
			for _, p := range ve.Problems {
				fmt.Fprintln(out, p)
			}
			return fmt.Errorf("%s: %d problem(s)", path, len(ve.Problems))
		}
		return err
	}
	fmt.Fprintf(out, "%s: valid (mode %s, %d targets, %d excludes, %d workloads)\n", path, cfg.Mode, len(cfg.Targets), len(cfg.Exclude), len(cfg.Workloads))
	return nil
}

// InspectEntry is one verdict as inspect prints it.
type InspectEntry struct {
	Dest       string  `json:"dest"`
	State      string  `json:"state"`
	DueInSec   float64 `json:"due_in_seconds"`
	Round      uint32  `json:"round"`
	Tokens     uint32  `json:"tokens"`
	Probes     uint32  `json:"probes"`
	Errno      string  `json:"reject_errno"`
	CircuitID  uint32  `json:"circuit_id"`
	Rejected   uint64  `json:"rejected"`
	ProbesUsed uint64  `json:"probes_admitted"`
	// RejectedCgroups are the cgroup ids this verdict's circuit (id and
	// epoch) rejected, with their counts, from the rejections map.
	RejectedCgroups map[uint64]uint64 `json:"rejected_cgroups,omitempty"`
	// SlowStartRejected counts the connects the circuit's slow starts
	// turned away (a ramp verdict's rejections), and
	// SlowStartRejectedCgroups the cgroup ids they were turned away from.
	SlowStartRejected        uint64            `json:"slow_start_rejected,omitempty"`
	SlowStartRejectedCgroups map[uint64]uint64 `json:"slow_start_rejected_cgroups,omitempty"`
}

// InspectBulkhead is one destination's bulkhead (a limits entry with a
// limit) as inspect prints it.
type InspectBulkhead struct {
	Dest           string `json:"dest"`
	Slot           uint32 `json:"slot"`
	MaxConnections uint32 `json:"max_connections"`
	MaxConnecting  uint32 `json:"max_connecting"`
	// Connections and Connecting are the slot's live counts (shared by
	// the destinations of one slot).
	Connections int64 `json:"connections"`
	Connecting  int64 `json:"connecting"`
	// BulkheadRejected counts the slot's connects turned away.
	BulkheadRejected uint64 `json:"bulkhead_rejected"`
	// RejectedCgroups are the cgroup ids the slot (id and epoch) turned
	// away, with their counts, from the rejections map.
	RejectedCgroups map[uint64]uint64 `json:"rejected_cgroups,omitempty"`
}

// InspectReport is what inspect prints.
type InspectReport struct {
	HeartbeatAgeSec float64           `json:"heartbeat_age_seconds"`
	FailsafeSec     float64           `json:"failsafe_seconds"`
	Enforcing       bool              `json:"enforcing"`
	Shadow          bool              `json:"shadow"`
	EventsLost      uint64            `json:"events_lost"`
	Verdicts        []InspectEntry    `json:"verdicts"`
	Bulkheads       []InspectBulkhead `json:"bulkheads"`
}

func inspect(dir string, asJSON bool, out io.Writer) error {
	v, err := maps.OpenPinned(dir)
	if err != nil {
		return err
	}
	defer v.Close()
	s, err := v.Settings()
	if err != nil {
		return err
	}
	now := maps.Now()
	rep := InspectReport{HeartbeatAgeSec: (now - s.Heartbeat).Seconds(), FailsafeSec: s.FailSafe.Seconds(), Shadow: s.Shadow}
	rep.Enforcing = s.Heartbeat != 0 && now-s.Heartbeat <= s.FailSafe
	if st, err := v.Stats(); err == nil {
		rep.EventsLost = st.EventsLost
	}
	all, err := v.AllVerdicts()
	if err != nil {
		return err
	}
	// The cgroups each (id, epoch) turned away: open (a verdict's), by a
	// bulkhead (a limit's) and by a slow start (a ramp verdict's),
	// counted apart.
	type owner struct{ id, epoch uint32 }
	byOwner, byBulkhead, byRamp := map[owner]map[uint64]uint64{}, map[owner]map[uint64]uint64{}, map[owner]map[uint64]uint64{}
	add := func(m map[owner]map[uint64]uint64, o owner, cg, n uint64) {
		if n == 0 {
			return
		}
		if m[o] == nil {
			m[o] = map[uint64]uint64{}
		}
		m[o][cg] += n
	}
	if rs, err := v.Rejections(); err == nil {
		for _, r := range rs {
			o := owner{r.CircuitID, r.Epoch}
			add(byOwner, o, r.CgroupID, r.Rejected)
			add(byBulkhead, o, r.CgroupID, r.BulkheadRejected)
			add(byRamp, o, r.CgroupID, r.SlowStartRejected)
		}
	}
	rep.Verdicts = []InspectEntry{}
	for d, vd := range all {
		e := InspectEntry{Dest: d.String(), State: vd.State.String(), Round: vd.Round, Probes: vd.Probes,
			Errno: policy.ErrnoName(vd.Errno), CircuitID: vd.CircuitID}
		if vd.State == maps.Open {
			e.DueInSec = (vd.Due - now).Seconds()
			// The circuit's budget: the tokens left when it is in this
			// verdict's round, all of them when the round has not begun.
			e.Tokens = vd.Probes
			if b, err := v.Budget(vd.CircuitID); err == nil && b.Round == vd.Round {
				e.Tokens = b.Tokens
			}
			if e.DueInSec <= 0 {
				e.State = "half_open"
			}
		}
		if cnt, err := v.Counters(vd.CircuitID); err == nil {
			e.Rejected, e.ProbesUsed, e.SlowStartRejected = cnt.Rejected, cnt.Probes, cnt.SlowStartRejected
		}
		if vd.Epoch != 0 {
			e.RejectedCgroups = byOwner[owner{vd.CircuitID, vd.Epoch}]
			e.SlowStartRejectedCgroups = byRamp[owner{vd.CircuitID, vd.Epoch}]
		}
		rep.Verdicts = append(rep.Verdicts, e)
	}
	sort.Slice(rep.Verdicts, func(i, j int) bool { return rep.Verdicts[i].Dest < rep.Verdicts[j].Dest })
	limits, err := v.AllLimits()
	if err != nil {
		return err
	}
	rep.Bulkheads = []InspectBulkhead{}
	for d, l := range limits {
		if l.MaxConnections == 0 && l.MaxConnecting == 0 {
			continue // an entry for responses only
		}
		b := InspectBulkhead{Dest: d.String(), Slot: l.Slot, MaxConnections: l.MaxConnections, MaxConnecting: l.MaxConnecting}
		if n, err := v.BulkCount(l.Slot); err == nil {
			b.Connections, b.Connecting = n.Connections, n.Connecting
		}
		if cnt, err := v.Counters(l.Slot); err == nil {
			b.BulkheadRejected = cnt.BulkheadRejected
		}
		if l.Epoch != 0 {
			b.RejectedCgroups = byBulkhead[owner{l.Slot, l.Epoch}]
		}
		rep.Bulkheads = append(rep.Bulkheads, b)
	}
	sort.Slice(rep.Bulkheads, func(i, j int) bool { return rep.Bulkheads[i].Dest < rep.Bulkheads[j].Dest })
	if asJSON {
		return writeJSON(out, rep)
	}
	mode := "enforcing"
	if !rep.Enforcing {
		mode = "NOT enforcing (heartbeat stale: the kernel lets everything through)"
	}
	if rep.Shadow {
		mode += ", shadow"
	}
	fmt.Fprintf(out, "heartbeat %.1fs ago, fail-safe %.0fs: %s; events lost %d\n", rep.HeartbeatAgeSec, rep.FailsafeSec, mode, rep.EventsLost)
	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DEST\tSTATE\tDUE IN\tROUND\tTOKENS\tERRNO\tCIRCUIT\tREJECTED\tCGROUPS REJECTED")
	for _, e := range rep.Verdicts {
		// Rejections by kind as status writes them (5+slow-start:3), and
		// the cgroups turned away by either.
		cgroups := len(e.RejectedCgroups)
		for cg := range e.SlowStartRejectedCgroups {
			if _, ok := e.RejectedCgroups[cg]; !ok {
				cgroups++
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%.1fs\t%d\t%d/%d\t%s\t%d\t%s\t%d\n", e.Dest, e.State, e.DueInSec, e.Round, e.Tokens, e.Probes, e.Errno, e.CircuitID,
			rejectionCounts(e.Rejected, 0, e.SlowStartRejected), cgroups)
	}
	if err := tw.Flush(); err != nil || len(rep.Bulkheads) == 0 {
		return err
	}
	fmt.Fprintln(out)
	tw = tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "BULKHEAD\tSLOT\tCONNS\tCONNECTING\tBULKHEAD REJECTED\tCGROUPS REJECTED")
	limit := func(n int64, max uint32) string {
		if max == 0 {
			return strconv.FormatInt(n, 10)
		}
		return fmt.Sprintf("%d/%d", n, max)
	}
	for _, b := range rep.Bulkheads {
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%d\n", b.Dest, b.Slot, limit(b.Connections, b.MaxConnections), limit(b.Connecting, b.MaxConnecting), b.BulkheadRejected, len(b.RejectedCgroups))
	}
	return tw.Flush()
}

func writeJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (c *client) get(path string, v any) error {
	_, err := c.getPage(path, v)
	return err
}

// getPage gets path and returns the next page's path from the Link
// header ("" on the last page).
func (c *client) getPage(path string, v any) (next string, err error) {
	req, err := http.NewRequest("GET", c.base+path, nil)
	if err != nil {
		return "", err
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return "", fmt.Errorf("reaching breakerd: %w", err)
	}
	if err := decode(resp, v); err != nil {
		return "", err
	}
	for _, l := range resp.Header.Values("Link") {
		if target, rel, ok := strings.Cut(l, ";"); ok && strings.TrimSpace(rel) == `rel="next"` {
			return strings.Trim(strings.TrimSpace(target), "<>"), nil
		}
	}
	return "", nil
}

// circuits reads every page of /v1/circuits.
func (c *client) circuits() ([]api.CircuitInfo, error) {
	all := []api.CircuitInfo{}
	for path := "/v1/circuits"; path != ""; {
		var page []api.CircuitInfo
		next, err := c.getPage(path, &page)
		if err != nil {
			return nil, err
		}
		if !strings.HasPrefix(next, "/v1/circuits?") {
			next = ""
		}
		all = append(all, page...)
		path = next
	}
	return all, nil
}

func (c *client) post(path string, body any, v any) error {
	b, _ := json.Marshal(body)
	req, err := http.NewRequest("POST", c.base+path, bytes.NewReader(b))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("reaching breakerd: %w", err)
	}
	return decode(resp, v)
}

func decode(resp *http.Response, v any) error {
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error string `json:"error"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&e)
		return fmt.Errorf("breakerd answered %s: %s", resp.Status, e.Error)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("decoding breakerd's answer: %w", err)
	}
	return nil
}

// connsOf shows a circuit's bulkhead use against its limit: its count, or,
// for a circuit whose sharing workloads have bulkheads of their own, the
// fullest workload's count and how many there are.
// limitOf is the limit the kernel enforces for key (max_connections or
// max_connecting): an adaptive limit's current value, else the option's;
// alg names the adaptive algorithm ("" for a static limit).
func limitOf(ci api.CircuitInfo, key string) (limit int, alg string) {
	for _, a := range ci.AdaptiveLimits {
		if a.Kind == key {
			return a.Limit, a.Algorithm
		}
	}
	mc, _ := ci.Options[key].(float64)
	return int(mc), ""
}

// bulkheadOf shows the count against key's limit, and an adaptive
// limit's algorithm: "3/12", "3/12 vegas".
func bulkheadOf(ci api.CircuitInfo, key string) (string, bool) {
	limit, alg := limitOf(ci, key)
	if limit <= 0 {
		return "", false
	}
	s := fmt.Sprintf("%d/%d conn.", ci.Connecting, limit)
	if key == "max_connections" {
		s = connsOf(ci, limit)
	}
	if alg != "" {
		s += " " + alg
	}
	return s, true
}

func connsOf(ci api.CircuitInfo, limit int) string {
	if len(ci.Bulkheads) == 0 {
		return fmt.Sprintf("%d/%d", ci.Connections, limit)
	}
	fullest := int64(0)
	for _, b := range ci.Bulkheads {
		fullest = max(fullest, b.Connections)
	}
	return fmt.Sprintf("%d/%d (fullest of %d workloads)", fullest, limit, len(ci.Bulkheads))
}

// rejectedBy lists the pods (or cgroups) a circuit rejected with their
// counts, most first, and how many more the API left out; "" when none:
// "shop/web-1:5,shop/web-2:bulkhead:3,shop/web-3:2+bulkhead:1,shop/web-4:slow-start:4"
// (web-1 turned away 5 times by the open circuit, web-2 3 times by its
// bulkhead, web-3 both, web-4 4 times by its slow start).
func rejectedBy(ci api.CircuitInfo) string {
	parts := make([]string, 0, len(ci.RejectedBy)+1)
	for _, r := range ci.RejectedBy {
		// Shadow mode: what it would have rejected.
		open := cmp.Or(r.Rejected, r.ShadowRejected)
		bulk := cmp.Or(r.BulkheadRejected, r.BulkheadShadowRejected)
		ramp := cmp.Or(r.SlowStartRejected, r.SlowStartShadowRejected)
		parts = append(parts, r.Label()+":"+rejectionCounts(open, bulk, ramp))
	}
	if more := ci.RejectedByTotal - len(ci.RejectedBy); more > 0 {
		parts = append(parts, fmt.Sprintf("+%d more", more))
	}
	return strings.Join(parts, ",")
}

// rejectionCounts writes one pod's (or one circuit's) rejections by kind:
// the open circuit's bare, then "bulkhead:N" and "slow-start:N", joined by
// "+", each only when not 0 ("0" when all are).
func rejectionCounts(open, bulk, ramp uint64) string {
	var kinds []string
	if open > 0 || bulk == 0 && ramp == 0 {
		kinds = append(kinds, strconv.FormatUint(open, 10))
	}
	if bulk > 0 {
		kinds = append(kinds, "bulkhead:"+strconv.FormatUint(bulk, 10))
	}
	if ramp > 0 {
		kinds = append(kinds, "slow-start:"+strconv.FormatUint(ramp, 10))
	}
	return strings.Join(kinds, "+")
}
