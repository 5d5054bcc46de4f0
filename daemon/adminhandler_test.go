package daemon

import (
	"net/http"

	"github.com/breakerd/breakerd/admin"
)

// The exposures the daemon's tests serve the admin API with.
const (
	exposeAll = admin.ExposeAll
	exposeTCP = admin.ExposeTCP
)

// handler is the admin API over d, as one of its servers serves it.
func (d *Daemon) handler(exp admin.Exposure, token []byte) http.Handler {
	return admin.Handler(d, exp, token)
}

// apiError is the admin API's error body.
type apiError struct {
	Error string `json:"error"`
}
