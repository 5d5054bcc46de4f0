package engine

import (
	"github.com/breakerd/breakerd/engine/enginetest"
)

var (
	_ Kernel = (*enginetest.Kernel)(nil)
	_ Clock  = (*enginetest.Clock)(nil)
)
