package admin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/breakerd/breakerd/api"
	"github.com/breakerd/breakerd/internal/browsertest"
)

// TestUIScriptInsertsTextOnly keeps the page's script away from every DOM
// call that parses markup: names are inserted with textContent only.
func TestUIScriptInsertsTextOnly(t *testing.T) {
	js := string(uiPages["/ui/app.js"].body)
	for _, bad := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function", "createContextualFragment", "DOMParser", "srcdoc"} {
		if strings.Contains(js, bad) {
			t.Errorf("app.js uses %s", bad)
		}
	}
	html := string(uiPages["/"].body)
	if regexp.MustCompile(`(?i)(src|href)="(https?:)?//`).MatchString(html) {
		t.Error("index.html loads something from another origin")
	}
	if regexp.MustCompile(`<script>|<style>|\son[a-z]+=|\sstyle=`).MatchString(html) {
		t.Error("index.html has inline script or event handlers (the CSP forbids them)")
	}
}

func TestUIServesStaticFiles(t *testing.T) {
	for path, ctype := range map[string]string{"/": "text/html", "/ui/app.js": "text/javascript", "/ui/app.css": "text/css"} {
		rec := httptest.NewRecorder()
		serveUI(rec, httptest.NewRequest("GET", path, nil))
		if rec.Code != 200 || !strings.HasPrefix(rec.Header().Get("Content-Type"), ctype) || rec.Header().Get("Content-Security-Policy") != uiContentSecurity || rec.Body.Len() == 0 {
			t.Errorf("GET %s: %d %q %d bytes", path, rec.Code, rec.Header().Get("Content-Type"), rec.Body.Len())
		}
		etag := rec.Header().Get("ETag")
		req := httptest.NewRequest("GET", path, nil)
		req.Header.Set("If-None-Match", etag)
		rec = httptest.NewRecorder()
		serveUI(rec, req)
		if rec.Code != http.StatusNotModified || rec.Body.Len() != 0 {
			t.Errorf("GET %s If-None-Match: %d", path, rec.Code)
		}
	}
	rec := httptest.NewRecorder()
	serveUI(rec, httptest.NewRequest("GET", "/ui/../admin.go", nil))
	if rec.Code != http.StatusNotFound {
		t.Errorf("GET /ui/../admin.go: %d", rec.Code)
	}
}

// hostile is a name that would run code if any part of the page parsed it
// as HTML.
const hostile = `x<img src=x onerror="window.__pwned=1"></td><script>window.__pwned=2</script>`

// stubAPI serves the page and a fake /v1 API whose names, targets,
// workloads, failed pods and reasons are all hostile. breakerd's own
// names cannot carry markup today (target and workload names match
// [a-z0-9_-]+, circuit names add addresses, pods are Kubernetes names):
// the stub shows what the page does with whatever reaches it.
type stubAPI struct {
	token    string
	rejected atomic.Uint64
	mu       sync.Mutex
	requests []string
}

func (s *stubAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.requests = append(s.requests, r.URL.RequestURI())
	s.mu.Unlock()
	if !strings.HasPrefix(r.URL.Path, "/v1/") {
		serveUI(w, r)
		return
	}
	if s.token != "" && r.Header.Get("Authorization") != "Bearer "+s.token {
		writeError(w, http.StatusForbidden, "circuits, destinations and events are served to loopback clients, on the unix socket, or with the bearer token (--admin-token-file)")
		return
	}
	n := s.rejected.Add(7)
	open := api.CircuitInfo{Name: hostile + "/198.18.0.2:80", Target: hostile, Scope: "endpoint", State: "open", FailureRate: 1, Calls: 5, Failures: 5,
		OpenUntil: time.Now().Add(time.Minute), Rejected: n, Options: map[string]any{"max_connections": 10}, Connections: 3,
		Fallback: "198.18.1.2:8080", Redirected: 12}
	closed := api.CircuitInfo{Name: "tcp/198.18.0.3:80", Target: "all", Scope: "dynamic", State: "closed", Calls: 2, Options: map[string]any{},
		SlowStart: &api.SlowStart{Share: 0.4, Until: time.Now().Add(20 * time.Second)}}
	switch {
	case r.URL.Path == "/v1/circuits":
		// Two pages of one circuit each: the page must follow the Link.
		if r.URL.Query().Get("after") == "" {
			next := url.Values{"after": {open.Name}, "limit": {"1"}}
			w.Header().Set("Link", "</v1/circuits?"+next.Encode()+`>; rel="next"`)
			writeJSON(w, 200, []any{withWorkloads(open)})
			return
		}
		writeJSON(w, 200, []any{closed})
	case strings.HasPrefix(r.URL.Path, "/v1/circuits/"):
		writeJSON(w, 200, withWorkloads(open))
	case r.URL.Path == "/v1/events":
		writeJSON(w, 200, []map[string]any{{"time": time.Now(), "circuit": open.Name, "target": hostile, "workload": "w/" + hostile,
			"from": "closed", "to": "open", "reason": hostile, "failure_rate": 1, "calls": 5}})
	default:
		writeError(w, 404, "no endpoint")
	}
}

// withWorkloads adds a hostile workload and failed pod, as JSON.
func withWorkloads(ci api.CircuitInfo) map[string]any {
	b, _ := json.Marshal(ci)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	m["workload"] = "kubepods.slice/" + hostile
	m["failed_pods"] = []string{"ns/" + hostile}
	m["rejected_by"] = []map[string]any{{"pod": "ns/" + hostile, "rejected": 7}, {"cgroup": "system.slice/" + hostile, "rejected": 2, "bulkhead_rejected": 1},
		{"pod": "ns/b-" + hostile, "bulkhead_rejected": 4}, {"pod": "ns/c-" + hostile, "slow_start_rejected": 3},
		{"pod": "ns/d-" + hostile, "bulkhead_rejected": 1, "slow_start_shadow_rejected": 2}}
	m["rejected_by_total"] = 6
	return m
}

// TestUIHostileNamesAreText loads the page in Chromium against the stub
// and checks through the DOM that every hostile string is shown as text:
// no element was made from it, no script ran, and the literal text is on
// the page. It also checks the token form for a server that needs one,
// the paging and a filter given in the address.
func TestUIHostileNamesAreText(t *testing.T) {
	stub := &stubAPI{token: "s3cret"}
	srv := httptest.NewServer(stub)
	defer srv.Close()
	ctx := browsertest.New(t, 60*time.Second)
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible("#auth")); err != nil {
		t.Fatalf("the token form is not shown for a 403: %v", err)
	}
	browsertest.Screenshot(ctx, t, "1-token-asked")
	if err := chromedp.Do(ctx, chromedp.SendKeys("#token", "s3cret"), chromedp.Click("#auth-form button"),
		chromedp.WaitNotVisible("#auth"), chromedp.WaitVisible("td.name")); err != nil {
		t.Fatalf("after the token: %v", err)
	}
	// The rate is computed between two polls.
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`(document.querySelector("#rows tr.row-open td.rate")?.textContent ?? "0.0") !== "0.0"`,
		chromedp.WithPollingTimeout(30*time.Second), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
		t.Fatalf("no rejection rate between polls: %v", err)
	}
	browsertest.Screenshot(ctx, t, "2-hostile-names")

	type pageState struct {
		Images, Scripts, Pwned int
		Names, Targets, Work   []string
		Events, Reasons        []string
		EventWork              []string
		Pods                   []string
		Rejected               []string
		Rows                   int
		Rate                   string
		States                 []string
	}
	var st pageState
	st, err := chromedp.Run(ctx, chromedp.Evaluate[pageState](`(() => {
		const texts = (sel) => [...document.querySelectorAll(sel)].map((e) => e.textContent);
		return {
			Images: document.querySelectorAll("img").length,
			Scripts: document.querySelectorAll("script").length,
			Pwned: window.__pwned || 0,
			Names: texts("#rows td.name"),
			Targets: [...document.querySelectorAll("#rows tr")].map((tr) => tr.children[2] ? tr.children[2].textContent : ""),
			Work: [...document.querySelectorAll("#rows td.workloads")].map((td) => td.firstChild.textContent),
			Pods: texts("#rows td.workloads .pods"),
			Rejected: texts("#rows td.workloads .rejected-by"),
			Events: [...document.querySelectorAll("#event-rows td.name")].map((td) => td.firstChild.textContent),
			EventWork: texts("#event-rows td.name .hint"),
			Reasons: [...document.querySelectorAll("#event-rows tr")].map((tr) => tr.children[4].textContent),
			Rows: document.querySelectorAll("#rows tr").length,
			Rate: document.querySelector("#rows tr.row-open td.rate").textContent,
			States: [...document.querySelectorAll("#rows tr")].map((tr) => tr.children[0] ? tr.children[0].textContent : ""),
		};
	})()`))
	if err != nil {
		t.Fatal(err)
	}
	if st.Images != 0 || st.Scripts != 1 || st.Pwned != 0 {
		t.Fatalf("markup from a name reached the DOM: %d img, %d script elements, __pwned=%d", st.Images, st.Scripts, st.Pwned)
	}
	if st.Rows != 2 {
		t.Fatalf("%d rows: want both pages' circuits", st.Rows)
	}
	want := hostile + "/198.18.0.2:80"
	if !slices.Contains(st.Names, want) || !slices.Contains(st.Targets, hostile) || !slices.Contains(st.Work, "kubepods.slice/"+hostile) ||
		!slices.Contains(st.Events, want) || !slices.Contains(st.Reasons, hostile) || !slices.Contains(st.EventWork, " (w/"+hostile+")") ||
		!slices.Contains(st.Pods, "pods with failures: ns/"+hostile) ||
		!slices.Contains(st.Rejected, "rejected: ns/"+hostile+": 7, system.slice/"+hostile+": 2 (and 1 by the bulkhead), ns/b-"+hostile+": 4 by the bulkhead, ns/c-"+hostile+": 3 by the slow start, ns/d-"+hostile+": 1 by the bulkhead (and 2 by the slow start), +1 more") {
		t.Fatalf("the literal text is not shown: %+v", st)
	}
	// A closed circuit that is ramping up after recovery says so.
	if !slices.Contains(st.States, "closed ramping: 40% admitted") {
		t.Fatalf("the ramping circuit's state cells: %q", st.States)
	}
	if st.Rate == "0.0" || st.Rate == "" {
		t.Fatalf("no rejection rate between polls: %q", st.Rate)
	}

	// The detail panel (GET /v1/circuits/{name}) shows the name as text.
	if err := chromedp.Do(ctx, chromedp.Click("#rows tr.row-open"), chromedp.WaitVisible("#detail")); err != nil {
		t.Fatal(err)
	}
	detail, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById("detail-name").textContent`))
	if err != nil || detail != want {
		t.Fatalf("detail name %q (%v)", detail, err)
	}
	// A circuit running on its fallback says so, in its row and its detail.
	fb, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`[document.querySelector("#rows tr.row-open td").textContent, document.getElementById("detail-body").textContent]`))
	if err != nil || len(fb) != 2 || !strings.Contains(fb[0], "to fallback: 12") || !strings.Contains(fb[1], "fallback198.18.1.2:8080 (12 connects sent there)") {
		t.Fatalf("the fallback is not shown: %q (%v)", fb, err)
	}
	stub.mu.Lock()
	asked := strings.Join(stub.requests, "\n")
	stub.mu.Unlock()
	if !strings.Contains(asked, "/v1/circuits/"+url.PathEscape(hostile)[:10]) || !strings.Contains(asked, "after=") {
		t.Errorf("requests do not show paging and an escaped detail path:\n%s", asked)
	}

	// A filter given in the address (a crafted link) is shown as text too.
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/#q="+url.QueryEscape(`<img src=y onerror="window.__pwned=3">`)),
		chromedp.WaitVisible("td.empty")); err != nil {
		t.Fatal(err)
	}
	type filtered struct {
		Images, Pwned int
		Empty, Value  string
	}
	f, err := chromedp.Run(ctx, chromedp.Evaluate[filtered](`({Images: document.querySelectorAll("img").length, Pwned: window.__pwned || 0,
		Empty: document.querySelector("#rows td.empty").textContent, Value: document.getElementById("filter").value})`))
	if err != nil {
		t.Fatal(err)
	}
	browsertest.Screenshot(ctx, t, "3-hostile-filter")
	if f.Images != 0 || f.Pwned != 0 || !strings.Contains(f.Empty, `<img src=y onerror="window.__pwned=3">`) || f.Value != `<img src=y onerror="window.__pwned=3">` {
		t.Fatalf("filter from the address: %+v", f)
	}
}

// manyAPI serves n circuits through the real paging rules (name order,
// ?after=, ?limit=, a Link to the next page).
type manyAPI struct{ circuits []api.CircuitInfo }

func newManyAPI(n int) *manyAPI {
	m := &manyAPI{}
	for i := range n {
		c := api.CircuitInfo{Name: fmt.Sprintf("tcp/198.18.%d.%d:80", i/250, i%250+1), Target: "all", Scope: "dynamic", State: "closed",
			FailureRate: float64(i%100) / 100, Calls: i % 100, Options: map[string]any{}}
		if i%100 == 0 {
			c.State, c.Rejected = "open", uint64(i)
		}
		m.circuits = append(m.circuits, c)
	}
	slices.SortFunc(m.circuits, func(a, b api.CircuitInfo) int { return strings.Compare(a.Name, b.Name) })
	return m
}

func (m *manyAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/v1/circuits":
		q := r.URL.Query()
		limit, _ := strconv.Atoi(q.Get("limit"))
		if limit < 1 || limit > PageSize {
			limit = PageSize
		}
		i, _ := slices.BinarySearchFunc(m.circuits, q.Get("after"), func(c api.CircuitInfo, after string) int {
			if c.Name <= after {
				return -1
			}
			return 1
		})
		page := m.circuits[i:min(len(m.circuits), i+limit)]
		if i+limit < len(m.circuits) {
			next := url.Values{"after": {page[len(page)-1].Name}, "limit": {strconv.Itoa(limit)}}
			w.Header().Set("Link", "</v1/circuits?"+next.Encode()+`>; rel="next"`)
		}
		writeJSON(w, 200, page)
	case "/v1/events":
		writeJSON(w, 200, []api.TransitionEvent{})
	default:
		serveUI(w, r)
	}
}

// TestUIThousandsOfCircuits: with 5,000 circuits (five pages) the page
// reads them all, draws one page of 50 rows, pages on, filters and sorts.
func TestUIThousandsOfCircuits(t *testing.T) {
	const n = 5000
	srv := httptest.NewServer(newManyAPI(n))
	defer srv.Close()
	ctx := browsertest.New(t, 60*time.Second)
	t0 := time.Now()
	if err := chromedp.Do(ctx, chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible("td.name")); err != nil {
		t.Fatal(err)
	}
	t.Logf("first table of %d circuits drawn %v after the navigation", n, time.Since(t0).Round(time.Millisecond))
	type view struct {
		Rows         int
		Info, First  string
		Summary      string
		Charts       int
		NextDisabled bool
	}
	read := func() view {
		v, err := chromedp.Run(ctx, chromedp.Evaluate[view](`({Rows: document.querySelectorAll("#rows tr").length,
			Info: document.getElementById("pageinfo").textContent,
			First: document.querySelector("#rows td.name").textContent,
			Summary: document.getElementById("summary").textContent,
			Charts: document.querySelectorAll(".chart").length,
			NextDisabled: document.getElementById("next").disabled})`))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	v := read()
	if v.Rows != 50 || v.Info != "rows 1–50 of 5000 (page 1 of 100)" || !strings.HasPrefix(v.Summary, "5000 circuits") || v.Charts > 13 {
		t.Fatalf("first view: %+v", v)
	}
	browsertest.Screenshot(ctx, t, "5000-circuits")
	if err := chromedp.Do(ctx, chromedp.Click("#next")); err != nil {
		t.Fatal(err)
	}
	if v := read(); v.Info != "rows 51–100 of 5000 (page 2 of 100)" {
		t.Fatalf("after next: %+v", v)
	}
	// Sorting by failure ratio, then a filter that leaves one circuit.
	if err := chromedp.Do(ctx, chromedp.SetValue("#sort", "failure"), chromedp.Evaluate[chromedp.Void](`document.getElementById("sort").dispatchEvent(new Event("input"))`)); err != nil {
		t.Fatal(err)
	}
	if v := read(); v.Info != "rows 1–50 of 5000 (page 1 of 100)" {
		t.Fatalf("after sorting: %+v", v)
	}
	top, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector("#rows tr td:nth-child(5)").textContent`))
	if err != nil || top != "99%" {
		t.Fatalf("sorted by failure ratio, the first row shows %q (%v)", top, err)
	}
	if err := chromedp.Do(ctx, chromedp.SendKeys("#filter", "198.18.19.250:")); err != nil {
		t.Fatal(err)
	}
	if v := read(); v.Rows != 1 || v.First != "tcp/198.18.19.250:80" || !v.NextDisabled {
		t.Fatalf("after filtering: %+v", v)
	}
}

// TestUIPageServedWithoutData: on TCP the page is served to anyone, the
// same bytes whoever asks, and its data calls keep the API's rules.
func TestUIPageServedWithoutData(t *testing.T) {
	tcp := Handler(&fakeBackend{}, ExposeTCP, nil)
	remote := "192.0.2.7:40000"
	for _, p := range []string{"/", "/ui/app.js", "/ui/app.css"} {
		rec := do(t, tcp, "GET", p, "", remote)
		if rec.Code != http.StatusOK || !bytes.Equal(rec.Body.Bytes(), uiPages[p].body) || rec.Header().Get("Content-Security-Policy") == "" {
			t.Errorf("remote GET %s: %d, %d bytes", p, rec.Code, rec.Body.Len())
		}
		if strings.Contains(rec.Body.String(), "svc") {
			t.Errorf("GET %s names a circuit", p)
		}
	}
	if rec := do(t, tcp, "HEAD", "/", "", remote); rec.Code != http.StatusOK || rec.Body.Len() != 0 {
		t.Errorf("HEAD /: %d, %d bytes", rec.Code, rec.Body.Len())
	}
	if rec := do(t, tcp, "POST", "/", "", remote); rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST /: %d", rec.Code)
	}
	for _, p := range []string{"/v1/circuits", "/v1/events", "/v1/circuits/svc"} {
		if rec := do(t, tcp, "GET", p, "", remote); rec.Code != http.StatusForbidden {
			t.Errorf("remote GET %s: %d", p, rec.Code)
		}
	}
	for _, p := range []string{"/ui/", "/ui/index.html", "/index.html", "/ui/x/app.js"} {
		if rec := do(t, tcp, "GET", p, "", remote); rec.Code != http.StatusNotFound {
			t.Errorf("GET %s: %d", p, rec.Code)
		}
	}
}
