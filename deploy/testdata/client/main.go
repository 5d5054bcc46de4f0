// Command client is the client pod of the one-node cluster test: it
// connects to its argument every 200 ms and prints each outcome.
package main

import (
	"fmt"
	"net"
	"os"
	"time"
)

func main() {
	for {
		c, err := net.DialTimeout("tcp", os.Args[1], time.Second)
		if err == nil {
			fmt.Println("connected")
			c.Close()
		} else {
			fmt.Println("error:", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
