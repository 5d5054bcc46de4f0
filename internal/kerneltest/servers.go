package kerneltest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// Real servers of one test, on a server host (a network namespace of the
// test's own): PostgreSQL and memcached, for the response options (#19).
// Each is started by the test that uses it, stopped by its PID and its
// files removed when the test ends, also when it fails.

// PostgresPassword is the password of the postgres role of every test
// cluster: TCP connections authenticate with SCRAM, as Debian's clusters
// do by default.
const PostgresPassword = "breakerd-test"

// Postgres is a PostgreSQL server of one test.
type Postgres struct {
	// Host and Port are where it listens for TCP connections.
	Host *Host
	Port uint16
	// Dir holds the cluster (Dir/data) and the unix socket.
	Dir  string
	proc *Process
	logs LogBuffer
}

// postgresBinary is a server-side PostgreSQL program (initdb, postgres,
// pg_isready) of the newest installed major version: Debian keeps them out
// of PATH, in /usr/lib/postgresql/<major>/bin.
func postgresBinary(tb testing.TB, name string) string {
	tb.Helper()
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/" + name)
	major := func(p string) int { v, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(p)))); return v }
	slices.SortFunc(found, func(a, b string) int { return major(a) - major(b) })
	if len(found) == 0 {
		if Emulated() {
			tb.Skipf("%s is not in the VM", name)
		}
		tb.Fatalf("no /usr/lib/postgresql/*/bin/%s (scripts/setup installs postgresql)", name)
	}
	return found[len(found)-1]
}

// StartPostgres makes a cluster with initdb in a new temporary directory
// and runs its server on the host's IPv4 address and port (and a unix
// socket in that directory) as the postgres user, since PostgreSQL refuses
// to run as root. It returns once the server accepts connections, having
// checked that over the unix socket: nothing has connected over TCP yet.
// When the test ends the server gets a fast shutdown (SIGINT, which ends
// its backends too; SIGKILL if it does not stop) and the directory goes.
func (h *Host) StartPostgres(tb testing.TB, port uint16) *Postgres {
	tb.Helper()
	initdb, server, ready := postgresBinary(tb, "initdb"), postgresBinary(tb, "postgres"), postgresBinary(tb, "pg_isready")
	u, err := user.Lookup("postgres")
	if err != nil {
		tb.Fatalf("the postgres user (the postgresql package makes it): %v", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	cred := func() *syscall.SysProcAttr {
		return &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	}
	// Not tb.TempDir: its parent is root's and closed to the postgres user.
	dir, err := os.MkdirTemp("", UniqueName()+"-pg-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	pw := filepath.Join(dir, "pw")
	if err := os.WriteFile(pw, []byte(PostgresPassword+"\n"), 0o600); err != nil {
		tb.Fatal(err)
	}
	for _, p := range []string{dir, pw} {
		if err := os.Chown(p, uid, gid); err != nil {
			tb.Fatal(err)
		}
	}
	env := []string{"PATH=" + os.Getenv("PATH"), "LC_ALL=C", "HOME=" + dir}
	data := filepath.Join(dir, "data")
	cmd := exec.Command(initdb, "-D", data, "-U", "postgres", "--pwfile", pw, "--auth-local=trust", "--auth-host=scram-sha-256",
		"-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
	cmd.Env, cmd.SysProcAttr, cmd.Dir = env, cred(), dir
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("initdb: %v\n%s", err, out)
	}
	// initdb allows TCP from loopback only; the clients are on the test's
	// client host (198.18.0.0/15).
	hba, err := os.OpenFile(filepath.Join(data, "pg_hba.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = hba.WriteString("host all all 198.18.0.0/15 scram-sha-256\n")
		err = errors.Join(err, hba.Close())
	}
	if err != nil {
		tb.Fatalf("pg_hba.conf: %v", err)
	}
	pg := &Postgres{Host: h, Port: port, Dir: dir}
	// ssl off (initdb's default too): libpq's SSLRequest is answered "N".
	pg.proc = h.Command(nil, server, "-D", data, "-p", strconv.Itoa(int(port)), "-k", dir, "-c", "listen_addresses="+h.IPv4.String(),
		"-c", "ssl=off", "-c", "fsync=off", "-c", "shared_buffers=16MB", "-c", "max_connections=20")
	pg.proc.Cmd.Env, pg.proc.Cmd.SysProcAttr, pg.proc.Cmd.Dir = env, cred(), dir
	pg.proc.Cmd.Stdout, pg.proc.Cmd.Stderr = &pg.logs, &pg.logs
	if err := pg.proc.Start(tb); err != nil {
		tb.Fatal(err)
	}
	// Registered after Start's cleanup, so it runs before it.
	tb.Cleanup(func() { pg.stop(tb) })
	up := WaitFor(10*time.Second, func() bool {
		return exec.Command(ready, "-q", "-h", dir, "-p", strconv.Itoa(int(port))).Run() == nil
	})
	if !up {
		tb.Fatalf("postgres did not start:\n%s", pg.logs.String())
	}
	return pg
}

func (pg *Postgres) stop(tb testing.TB) {
	if pg.proc.Cmd.ProcessState != nil {
		return
	}
	_ = pg.proc.Cmd.Process.Signal(syscall.SIGINT)
	done := make(chan struct{})
	go func() { _ = pg.proc.Cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		tb.Errorf("postgres (pid %d) did not stop on SIGINT; killing it:\n%s", pg.proc.Cmd.Process.Pid, pg.logs.String())
		_ = pg.proc.Cmd.Process.Kill()
		<-done
	}
}

// Logs is what the server wrote.
func (pg *Postgres) Logs() string { return pg.logs.String() }

// Client prepares a libpq client program (psql, pgbench) that will run in
// the client host c and cgroup cg, connecting over TCP as postgres with the
// password. libpq keeps its defaults (sslmode prefer: an SSLRequest first)
// but for GSSAPI encryption, which is turned off so that what it sends does
// not depend on a Kerberos credential cache (with none it does not try
// it anyway).
func (pg *Postgres) Client(c *Host, cg *Cgroup, name string, args ...string) *Process {
	args = append([]string{"-h", pg.Host.IPv4.String(), "-p", strconv.Itoa(int(pg.Port)), "-U", "postgres"}, args...)
	p := c.Command(cg, name, args...)
	p.Cmd.Env = append(os.Environ(), "PGPASSWORD="+PostgresPassword, "PGGSSENCMODE=disable", "PGSSLMODE=prefer",
		"PGCONNECT_TIMEOUT=5", "PGDATABASE=postgres")
	return p
}

// PSQL runs psql in c and cg, sending each of sqls as one query message on
// one connection (psql -c ... -c ...), and returns its output.
func (pg *Postgres) PSQL(tb testing.TB, c *Host, cg *Cgroup, sqls ...string) (string, error) {
	tb.Helper()
	args := []string{"-X", "-At", "-v", "ON_ERROR_STOP=1"}
	for _, s := range sqls {
		args = append(args, "-c", s)
	}
	out, err := pg.Client(c, cg, "psql", args...).Run(tb)
	return string(out), err
}

// PostgresStartTurns is how many request/response turns the start of a
// libpq connection to a test cluster takes: the SSLRequest (answered "N"),
// the startup message (answered AuthenticationSASL), and SCRAM's two
// messages (answered SASLContinue, then SASLFinal, AuthenticationOk, the
// parameters and ReadyForQuery together).
const PostgresStartTurns = 4

// Memcached is a memcached server of one test.
type Memcached struct {
	// Addr is host:port, as libmemcached's --servers takes it.
	Addr string
	proc *Process
	logs LogBuffer
}

// StartMemcached runs memcached on the host's IPv4 address and port (TCP
// only, one worker thread, as nobody) and returns once it answers (checked
// from the host itself, outside any cgroup). It is killed by PID when the
// test ends.
func (h *Host) StartMemcached(tb testing.TB, port uint16) *Memcached {
	tb.Helper()
	m := &Memcached{Addr: fmt.Sprintf("%s:%d", h.IPv4, port)}
	m.proc = h.Command(nil, "memcached", "-l", h.IPv4.String(), "-p", strconv.Itoa(int(port)), "-U", "0", "-t", "1", "-m", "16", "-u", "nobody")
	m.proc.Cmd.Stdout, m.proc.Cmd.Stderr = &m.logs, &m.logs
	if err := m.proc.Start(tb); err != nil {
		tb.Fatal(err)
	}
	up := WaitFor(5*time.Second, func() bool {
		_, err := h.Command(nil, "memcping", "--servers="+m.Addr).Run(tb)
		return err == nil
	})
	if !up {
		tb.Fatalf("memcached did not start: %s", m.logs.String())
	}
	return m
}

// Client prepares a libmemcached tool (memccat, memccp, memcping,
// memcslap, ...) against the server that will run in c and cg.
func (m *Memcached) Client(c *Host, cg *Cgroup, name string, args ...string) *Process {
	return c.Command(cg, name, append([]string{"--servers=" + m.Addr}, args...)...)
}

// Signal sends s to the server (SIGSTOP makes it silent: the kernel still
// completes handshakes and queues requests; SIGCONT lets it answer).
func (m *Memcached) Signal(tb testing.TB, s syscall.Signal) {
	tb.Helper()
	if err := m.proc.Cmd.Process.Signal(s); err != nil {
		tb.Fatalf("%v to memcached: %v", s, err)
	}
}
