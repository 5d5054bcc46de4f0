// Command demoserver is the small HTTP server scripts/demo runs on its
// namespaced test host: it answers every request with 200 and a line of
// text, on the address given as its only argument.
package main

import (
	"fmt"
	"log"
	"net/http"
	"os"
)

func main() {
	if len(os.Args) != 2 {
		log.Fatal("usage: demoserver ADDR")
	}
	log.Fatal(http.ListenAndServe(os.Args[1], http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello from the demo server")
	})))
}
