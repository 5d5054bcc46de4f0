// Package browsertest runs Debian's Chromium headless for the tests of
// breakerd's status page, and keeps their screenshots where a person can
// look at them.
//
// The browser is started with its background networking, component
// updates and sync off (it would otherwise try to reach the internet), a
// fresh profile directory per test, and no sandbox (the tests run as
// root). It only ever loads the loopback URLs a test gives it.
package browsertest

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// ChromiumPath is Debian's Chromium.
const ChromiumPath = "/usr/bin/chromium"

// New starts a headless Chromium for tb and returns a browser tab's
// context, cancelled (and the browser stopped) when the test ends. It
// skips the test when Chromium is missing (fails it under CI), and in
// vmtest's VM.
func New(tb testing.TB, timeout time.Duration) context.Context {
	tb.Helper()
	if kerneltest.Emulated() {
		// The page does not depend on the kernel: its browser tests run
		// on the host (in CI too), not in vmtest's emulated VM.
		tb.Skip("browser tests run on the host, not in the VM")
	}
	if kerneltest.Fast() {
		tb.Skip("browser test skipped: BREAKERD_FAST is set (scripts/test-fast)")
	}
	if _, err := os.Stat(ChromiumPath); err != nil {
		if kerneltest.InCI() {
			tb.Fatalf("%s is missing (scripts/setup installs Debian's chromium): %v", ChromiumPath, err)
		}
		tb.Skipf("%s is missing (scripts/setup installs Debian's chromium)", ChromiumPath)
	}
	profile := tb.TempDir()
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(ChromiumPath),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.UserDataDir(profile),
		chromedp.WindowSize(1400, 1000),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-default-apps", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-breakpad", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("no-proxy-server", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.Flag("password-store", "basic"),
	)
	ctx, cancelTab := chromedp.NewContext(alloc, chromedp.WithLogf(tb.Logf))
	ctx, cancelTimeout := context.WithTimeout(ctx, timeout)
	tb.Cleanup(func() {
		cancelTimeout()
		cancelTab()
		cancelAlloc() // stops the browser and waits for it
	})
	return ctx
}

var unsafeName = regexp.MustCompile(`[^A-Za-z0-9_.-]+`)

// ArtifactDir is where a test's screenshots go: $BREAKERD_ARTIFACTS/<test>
// when that is set, else /tmp/breakerd-artifacts/<test>. It is kept after
// the test so a person can look.
func ArtifactDir(tb testing.TB) string {
	tb.Helper()
	base := os.Getenv("BREAKERD_ARTIFACTS")
	if base == "" {
		base = filepath.Join(os.TempDir(), "breakerd-artifacts")
	}
	dir := filepath.Join(base, unsafeName.ReplaceAllString(tb.Name(), "_"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		tb.Fatalf("artifact directory: %v", err)
	}
	return dir
}

// Screenshot saves a full-page PNG of the tab as name.png in the test's
// artifact directory, logs its path and returns it.
func Screenshot(ctx context.Context, tb testing.TB, name string) string {
	tb.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		tb.Fatalf("screenshot %s: %v", name, err)
	}
	path := filepath.Join(ArtifactDir(tb), name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		tb.Fatal(err)
	}
	tb.Logf("screenshot: %s", path)
	return path
}
