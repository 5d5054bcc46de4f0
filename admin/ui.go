package admin

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"net/http"
	"strconv"
)

// The status page: three static files embedded in the binary (no external
// asset, works offline). They carry no data: the page's script reads
// /v1/circuits, /v1/circuits/{name} and /v1/events, which keep their own
// access rules, so serving the files to anyone leaks nothing.
//
//go:embed ui/index.html ui/app.js ui/app.css
var uiFiles embed.FS

// uiFile is one embedded file, read once.
type uiFile struct {
	body  []byte
	ctype string
	etag  string
}

// uiContentSecurity allows the page only its own script, style and
// connections: even a name that slipped past the script's text-only
// rendering could not run code or load anything.
const uiContentSecurity = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

func loadUIFile(name, ctype string) uiFile {
	b, err := uiFiles.ReadFile("ui/" + name)
	if err != nil {
		panic("admin: embedded " + name + " missing: " + err.Error()) // a build defect, caught by any test
	}
	sum := sha256.Sum256(b)
	return uiFile{body: b, ctype: ctype, etag: `"` + hex.EncodeToString(sum[:8]) + `"`}
}

var uiPages = map[string]uiFile{
	"/":           loadUIFile("index.html", "text/html; charset=utf-8"),
	"/ui/app.js":  loadUIFile("app.js", "text/javascript; charset=utf-8"),
	"/ui/app.css": loadUIFile("app.css", "text/css; charset=utf-8"),
}

// serveUI answers GET / and GET /ui/{file} with the embedded status page.
func serveUI(w http.ResponseWriter, r *http.Request) {
	f, ok := uiPages[r.URL.Path]
	if !ok {
		writeError(w, http.StatusNotFound, "no endpoint %s", Quote(r.URL.Path))
		return
	}
	h := w.Header()
	h.Set("Content-Security-Policy", uiContentSecurity)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-cache")
	h.Set("ETag", f.etag)
	if r.Header.Get("If-None-Match") == f.etag {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", f.ctype)
	h.Set("Content-Length", strconv.Itoa(len(f.body)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		_, _ = w.Write(f.body)
	}
}
