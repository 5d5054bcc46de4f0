// Package bench compares breakerd with what operators would use instead
// (a local HAProxy, an in-process library breaker) in one reproducible run;
// scripts/bench drives it.
package bench
