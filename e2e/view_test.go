package e2e

import (
	"cmp"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/breakerd/breakerd/internal/browsertest"
	"github.com/breakerd/breakerd/internal/kerneltest"
)

// Two named targets on the server host: web (port 8080, nothing listens:
// refused) trips; api (port 9090) sees no traffic and stays closed.
const viewConfig = `
failsafe_timeout: 5s
targets:
  web:
    match: {cidrs: [SRV0], ports: ["8080"]}
    consecutive_failures: 3
    open_duration: 1m
    jitter: 0
    reject_errno: ECONNREFUSED
  api:
    match: {cidrs: [SRV0], ports: ["9090"]}
`

// trip starts a real client process in the protected cgroup that connects
// to web every 50 ms for 40 s: refused by the host until the circuit
// opens, then rejected by the kernel.
func (w *world) trip() {
	w.t.Helper()
	w.topo.Client.StartDial(w.t, w.cg, kerneltest.DialSpec{Op: "loop", Network: "tcp4",
		Addr: netip.AddrPortFrom(w.topo.Servers[0].IPv4, 8080), Interval: 50 * time.Millisecond, For: 40 * time.Second, Timeout: time.Second})
}

// TestStatusPageShowsATrip loads the status page from a real breakerd in
// Debian's headless Chromium, trips a circuit with a real client, and
// checks through the browser's DOM that the circuit shows as open in its
// colour, that its rejections count up from one poll to the next, that it
// is charted and its transition listed; then the same across a SIGTERM
// and a SIGKILL restart and a reload. Screenshots are kept (the test logs
// their paths).
func TestStatusPageShowsATrip(t *testing.T) {
	w := newWorld(t, 1, viewConfig)
	w.start()
	ctx := browsertest.New(t, 90*time.Second)
	row := `#rows tr[data-name="web"]`
	// breakerd's own names cannot carry markup (target names match
	// [a-z0-9_-]+, circuit names add addresses; host names never reach the
	// API), but the filter in a link can: a crafted one is shown as text.
	evil := `<img src=x onerror="window.__pwned=1">`
	if err := chromedp.Do(ctx, chromedp.Navigate("http://"+w.admin+"/#q="+url.QueryEscape(evil)), chromedp.WaitVisible("#rows td.empty")); err != nil {
		t.Fatalf("the page with a filter in its address: %v", err)
	}
	type injected struct {
		Images, Pwned int
		Shown         string
	}
	inj, err := chromedp.Run(ctx, chromedp.Evaluate[injected](`({Images: document.querySelectorAll("img").length, Pwned: window.__pwned || 0,
		Shown: document.querySelector("#rows td.empty").textContent})`))
	if err != nil || inj.Images != 0 || inj.Pwned != 0 || !strings.Contains(inj.Shown, evil) {
		t.Fatalf("a filter with markup in the address: %+v (%v)", inj, err)
	}
	browsertest.Screenshot(ctx, t, "0-hostile-filter")
	if err := chromedp.Do(ctx, chromedp.Navigate("http://"+w.admin+"/"), chromedp.WaitVisible(row)); err != nil {
		t.Fatalf("the page shows no row for web: %v\n%s", err, w.logs.String())
	}
	state := func() string {
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('`+row+` .state').textContent`))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	if s := state(); s != "closed" {
		t.Fatalf("web is %q before the trip", s)
	}
	browsertest.Screenshot(ctx, t, "1-before-trip")

	w.trip()
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('`+row+` .state')?.textContent === "open"`,
		chromedp.WithPollingTimeout(20*time.Second), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
		t.Fatalf("the page never showed web open (the API says %q): %v", w.circuits()["web"].State, err)
	}
	colour, err := chromedp.Run(ctx, chromedp.Evaluate[string](`getComputedStyle(document.querySelector('`+row+` .state')).backgroundColor`))
	if err != nil || colour != "rgb(198, 40, 40)" {
		t.Fatalf("open is shown in %q, want the open colour rgb(198, 40, 40) (%v)", colour, err)
	}
	rejected := func() int {
		n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`Number(document.querySelector('`+row+` td.rejected').textContent)`))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	first := rejected()
	browsertest.Screenshot(ctx, t, "2-open")
	// The next polls show more rejections, and a rate above zero.
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](fmt.Sprintf(`Number(document.querySelector('%s td.rejected')?.textContent) > %d && Number(document.querySelector('%s td.rate')?.textContent) > 0`, row, first, row),
		chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(200*time.Millisecond))); err != nil {
		t.Fatalf("rejections did not count up from %d: %v", first, err)
	}
	// The chart gathers a point a poll: wait for a few, with more
	// rejections counted meanwhile.
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](fmt.Sprintf(`(() => {
		const line = document.querySelector('.chart[data-name="web"] polyline.fr');
		return !!line && line.getAttribute("points").split(" ").length >= 3 && Number(document.querySelector('%s td.rejected')?.textContent) > %d;
	})()`, row, first), chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(200*time.Millisecond))); err != nil {
		t.Fatalf("web's chart did not gather 3 points while rejections counted up from %d: %v", first, err)
	}
	second := rejected()
	if second <= first {
		t.Fatalf("rejections %d then %d", first, second)
	}
	shot := browsertest.Screenshot(ctx, t, "3-open-rejecting")

	type view struct {
		Summary, Events, Chart, Rate, API string
		Points                            int
	}
	v, err := chromedp.Run(ctx, chromedp.Evaluate[view](`(() => {
		const chart = document.querySelector('.chart[data-name="web"]');
		const ev = [...document.querySelectorAll("#event-rows tr")].find((tr) => tr.children[1].firstChild?.textContent === "web");
		return {
			Summary: document.getElementById("summary").textContent,
			Events: ev ? [...ev.children].map((td) => td.textContent).join("|") : "",
			Chart: chart ? chart.textContent : "",
			Points: chart ? chart.querySelector("polyline.fr").getAttribute("points").split(" ").length : 0,
			Rate: document.querySelector('`+row+` td.rate').textContent,
		};
	})()`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(v.Events, "|closed|open|consecutive_failures|") {
		t.Errorf("the transitions table lacks web closed -> open (consecutive_failures): %q", v.Events)
	}
	if !strings.Contains(v.Chart, "failure 100%") || v.Points < 3 {
		t.Errorf("web's chart: %q with %d points", v.Chart, v.Points)
	}
	if !strings.Contains(v.Summary, "open 1") {
		t.Errorf("summary %q does not count one open circuit", v.Summary)
	}
	// The page agrees with the API.
	c := w.circuits()["web"]
	if c.State != "open" || int(c.Rejected) < second {
		t.Errorf("API: %+v; page showed %d rejections", c, second)
	}
	// The cell's own text is the workload; below it, whom the circuit
	// rejected (the test's cgroup, with a count).
	wl, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('`+row+` td.workloads').childNodes[0].textContent`))
	if want := cmp.Or(c.Workload, "-"); err != nil || wl != want {
		t.Errorf("web's workload on the page %q, the API says %q (%v)", wl, want, err)
	}
	by, err := chromedp.Run(ctx, chromedp.Evaluate[string](`(document.querySelector('`+row+` td.workloads .rejected-by') || {textContent: ""}).textContent`))
	if err != nil || !strings.HasPrefix(by, "rejected: ") || !strings.Contains(by, filepath.Base(w.cg.Path)+": ") {
		t.Errorf("web's rejected cgroups on the page %q, want the test's cgroup %s with a count (%v)", by, filepath.Base(w.cg.Path), err)
	}
	t.Logf("web: %d then %d rejections, %s/s on the page; screenshot %s", first, second, v.Rate, shot)

	// A dynamic circuit (its name has a slash) opens its detail, read
	// from /v1/circuits/{name} with the name escaped.
	srv := w.topo.Servers[0]
	w.topo.Client.Dial(t, w.cg, kerneltest.DialSpec{Network: "tcp4", Addr: netip.AddrPortFrom(srv.IPv4, 7070)})
	dyn := fmt.Sprintf("tcp/%s:7070", srv.IPv4)
	if err := chromedp.Do(ctx, chromedp.Click(`#rows tr[data-name="`+dyn+`"]`), chromedp.WaitVisible("#detail")); err != nil {
		t.Fatalf("the dynamic circuit %s: %v", dyn, err)
	}
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](fmt.Sprintf(`document.getElementById("detail-name").textContent === %q &&
		document.getElementById("detail-body").textContent.includes("connect_timeout")`, dyn),
		chromedp.WithPollingTimeout(10*time.Second), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
		d, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById("detail").textContent`))
		t.Fatalf("the detail of %s: %v\n%s", dyn, err, d)
	}
	browsertest.Screenshot(ctx, t, "3b-detail")

	// Across a SIGTERM restart and a SIGKILL: the page says it cannot
	// reach breakerd while it is down, then shows web still open (adopted)
	// with its rejections going on from the kernel's counters; the client
	// never got a SYN through.
	syns := srv.SYNs(t)
	last := second
	for _, sig := range []os.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		w.signal(sig)
		if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.getElementById("conn").classList.contains("error")`,
			chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
			t.Fatalf("after %v the page does not say breakerd is unreachable: %v", sig, err)
		}
		browsertest.Screenshot(ctx, t, "4-down-after-"+strings.ToLower(sig.String()))
		w.start()
		if _, err := chromedp.Run(ctx, chromedp.Poll[bool](fmt.Sprintf(`!document.getElementById("conn").classList.contains("error") &&
			document.querySelector('%s .state')?.textContent === "open" && Number(document.querySelector('%s td.rejected')?.textContent) > %d &&
			Number(document.querySelector('%s td.rate')?.textContent) > 0`, row, row, last, row),
			chromedp.WithPollingTimeout(20*time.Second), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
			t.Fatalf("after the %v restart the page does not show web open with more than %d rejections: %v\n%s", sig, last, err, w.logs.String())
		}
		last = rejected()
	}
	shot = browsertest.Screenshot(ctx, t, "5-open-after-restarts")
	if ev, err := chromedp.Run(ctx, chromedp.Evaluate[string](`[...document.querySelectorAll("#event-rows tr")].map((tr) => tr.textContent).join("\n")`)); err != nil || !strings.Contains(ev, "consecutive_failures") {
		t.Errorf("the transition seen before the restarts is gone from the page (%v):\n%s", err, ev)
	}
	if n := srv.SYNs(t) - syns; n != 0 {
		t.Errorf("%d SYNs reached the host while web was open, across the restarts", n)
	}
	t.Logf("after a SIGTERM and a SIGKILL restart: web open, %d rejections; screenshot %s", last, shot)

	// A reload that drops api: the page drops its row and keeps web open.
	w.swapConfig(viewConfig[:strings.Index(viewConfig, "  api:")])
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`!document.querySelector('#rows tr[data-name="api"]') &&
		document.querySelector('`+row+` .state')?.textContent === "open"`,
		chromedp.WithPollingTimeout(20*time.Second), chromedp.WithPollingInterval(100*time.Millisecond))); err != nil {
		t.Fatalf("after a reload without api the page still shows it (or web is not open): %v\n%s", err, w.logs.String())
	}
}

// tmux drives a program in a real terminal (a tmux pane on its own
// server, removed when the test ends).
type tmux struct {
	t      *testing.T
	socket string
}

func newTmux(t *testing.T, width, height int, command string) *tmux {
	t.Helper()
	need(t, "tmux")
	tm := &tmux{t: t, socket: kerneltest.UniqueName()}
	t.Cleanup(func() { _ = exec.Command("tmux", "-L", tm.socket, "kill-server").Run() })
	tm.run("new-session", "-d", "-s", "top", "-x", fmt.Sprint(width), "-y", fmt.Sprint(height), command)
	return tm
}

func (tm *tmux) run(args ...string) string {
	tm.t.Helper()
	out, err := exec.Command("tmux", append([]string{"-L", tm.socket}, args...)...).CombinedOutput()
	if err != nil {
		tm.t.Fatalf("tmux %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// screen is the pane's text; with escapes, its colours too.
func (tm *tmux) screen(escapes bool) string {
	if escapes {
		return tm.run("capture-pane", "-p", "-e", "-t", "top")
	}
	return tm.run("capture-pane", "-p", "-t", "top")
}

func (tm *tmux) waitFor(what string, timeout time.Duration, cond func(screen string) bool) string {
	tm.t.Helper()
	var s string
	if !kerneltest.WaitFor(timeout, func() bool { s = tm.screen(false); return cond(s) }) {
		tm.t.Fatalf("the terminal never showed %s:\n%s", what, s)
	}
	return s
}

// rowOrder returns the names of the circuit rows as top shows them.
func rowOrder(screen string) []string {
	var names []string
	for _, l := range strings.Split(screen, "\n") {
		f := strings.Fields(l)
		if len(f) > 1 && (f[0] == "closed" || f[0] == "open" || f[0] == "half_open") {
			names = append(names, f[1])
		}
	}
	return names
}

// TestTopShowsATrip runs `breakerctl top` in a tmux terminal against a
// real breakerd: it draws both circuits, shows web open in red with its
// rejections after a real trip, re-sorts on the n and r keys, shows an
// error while the daemon restarts and recovers after it, and on q
// exits with status 0 and the terminal restored (primary screen, echo and
// canonical mode back).
func TestTopShowsATrip(t *testing.T) {
	w := newWorld(t, 1, viewConfig)
	w.start()
	done := filepath.Join(t.TempDir(), "done")
	cmd := fmt.Sprintf("%s top --socket %s --interval 1s; echo \"top exited $?\" > %s; stty -a >> %s; sleep 60",
		bin(t, "breakerctl"), w.socket, done, done)
	tm := newTmux(t, 150, 30, cmd)
	tm.waitFor("both circuits closed", 15*time.Second, func(s string) bool {
		return strings.Contains(s, "breakerd top") && len(rowOrder(s)) == 2 && !strings.Contains(s, " open ")
	})
	if alt := strings.TrimSpace(tm.run("display-message", "-p", "-t", "top", "#{alternate_on}")); alt != "1" {
		t.Errorf("top does not run on the alternate screen (alternate_on %s)", alt)
	}

	w.trip()
	s := tm.waitFor("web open with rejections", 20*time.Second, func(s string) bool {
		rej := -1 // the REJECTED column, from the header (WORKLOAD comes and goes)
		for _, l := range strings.Split(s, "\n") {
			f := strings.Fields(l)
			if len(f) > 0 && f[0] == "STATE" {
				rej = slices.Index(f, "REJECTED")
			}
			if rej > 0 && len(f) > rej && f[0] == "open" && f[1] == "web" && f[rej] != "0" {
				return true
			}
		}
		return false
	})
	t.Logf("top after the trip:\n%s", s)
	if o := rowOrder(s); o[0] != "web" {
		t.Errorf("sorted by state, the open web is not first: %v\n%s", o, s)
	}
	// The open state is drawn with a red background (SGR 41).
	colour := false
	for _, l := range strings.Split(tm.screen(true), "\n") {
		if strings.Contains(l, " web ") && (strings.Contains(l, "[41mopen ") || strings.Contains(l, ";41mopen ")) {
			colour = true
		}
	}
	if !colour {
		t.Errorf("web's open state is not drawn in red:\n%q", tm.screen(true))
	}

	tm.run("send-keys", "-t", "top", "n")
	tm.waitFor("the name order (api first)", 10*time.Second, func(s string) bool {
		o := rowOrder(s)
		return strings.Contains(s, "sort: name") && len(o) == 2 && o[0] == "api"
	})
	tm.run("send-keys", "-t", "top", "r")
	tm.waitFor("the rejections order (web first)", 10*time.Second, func(s string) bool {
		o := rowOrder(s)
		return strings.Contains(s, "sort: rejections/s") && len(o) == 2 && o[0] == "web"
	})
	// A daemon restart: top says it cannot read breakerd, then recovers.
	w.signal(syscall.SIGTERM)
	tm.waitFor("the error while breakerd is down", 10*time.Second, func(s string) bool { return strings.Contains(s, "error: reaching breakerd") })
	w.start()
	tm.waitFor("web open again after the restart", 20*time.Second, func(s string) bool {
		o := rowOrder(s)
		return !strings.Contains(s, "error:") && len(o) == 2 && o[0] == "web" && strings.Contains(s, "open 1")
	})
	tm.run("send-keys", "-t", "top", "q")
	var out []byte
	if !kerneltest.WaitFor(10*time.Second, func() bool {
		b, err := os.ReadFile(done)
		out = b
		return err == nil && strings.Contains(string(b), "speed")
	}) {
		t.Fatalf("top did not exit on q:\n%s", tm.screen(false))
	}
	if !strings.HasPrefix(string(out), "top exited 0\n") {
		t.Fatalf("top's exit: %s", out)
	}
	stty := string(out)
	if !strings.Contains(stty, " icanon") || !strings.Contains(stty, " echo ") || strings.Contains(stty, "-icanon") {
		t.Errorf("the terminal is not restored after top: %s", stty)
	}
	if alt := strings.TrimSpace(tm.run("display-message", "-p", "-t", "top", "#{alternate_on}")); alt != "0" {
		t.Errorf("the alternate screen is still on after top (alternate_on %s)", alt)
	}
	if scr := tm.screen(false); strings.Contains(scr, "breakerd top") {
		t.Errorf("top's screen is left on the terminal:\n%s", scr)
	}
}
