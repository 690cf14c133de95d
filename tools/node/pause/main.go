// Command pause is the pod sandbox's first process: it holds the pod's namespaces, reaps the
// orphans that land on it, and exits at SIGTERM/SIGINT. What registry.k8s.io/pause does (its
// source is C, not a Go package), built here because no image registry is reachable.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
