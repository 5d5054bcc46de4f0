package policy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"
	"golang.org/x/sys/unix"
)

// Limits on a configuration. They bound what reading, decoding, validating
// and matching can cost, whatever the file holds; docs/configuration.md
// lists them.
const (
	// MaxFileBytes is the largest configuration file read (at most one
	// byte more is read to tell that a file is too large).
	MaxFileBytes = 1 << 20
	// MaxDepth is the deepest nesting of mappings and lists (a valid file
	// needs 5: targets.<name>.match.cidrs[i]).
	MaxDepth = 16
	// MaxEntries bounds the mapping keys plus list items of a file.
	MaxEntries = 50_000
	// MaxTargets bounds the named targets.
	MaxTargets = 1_000
	// MaxExclude bounds the exclude blocks.
	MaxExclude = 1_000
	// MaxAddresses bounds the cidrs plus hosts of one match block.
	MaxAddresses = 1_000
	// MaxPorts bounds the ports and ranges of one match block.
	MaxPorts = 100
	// MaxMatchEntries bounds the address × port pairs of all targets and
	// excludes together, what the matcher indexes.
	MaxMatchEntries = 100_000
	// MaxHosts bounds the distinct host names, each resolved again every
	// resolve interval.
	MaxHosts = 256
	// MaxServices bounds the Service targets, each watched through the
	// Kubernetes API.
	MaxServices = 256
	// maxProblems is how many problems an invalid file reports (the rest
	// are counted).
	maxProblems = 100
)

// LoadFile reads, decodes and validates a configuration file, with
// BREAKERD_… environment variables overriding its keys. An empty path
// means the embedded default.
//
// Only a regular file is read (through symlinks), and at most
// MaxFileBytes of it: the file is opened without blocking and checked on
// the opened descriptor, so a FIFO, a device such as /dev/urandom or a
// directory is refused at once instead of hanging or filling memory.
func LoadFile(path string) (*Config, error) {
	if path == "" {
		return Parse(defaultYAML, true)
	}
	data, err := ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(data, true)
}

// ReadFile reads a configuration file as LoadFile does: a regular file
// only, opened with O_NONBLOCK and checked with fstat on the opened
// descriptor, no larger than MaxFileBytes.
func ReadFile(path string) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("reading configuration: %w", &os.PathError{Op: "open", Path: path, Err: err})
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("reading configuration: %w", &os.PathError{Op: "fstat", Path: path, Err: err})
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("reading configuration %s: %w (it is a %s)", path, ErrNotRegular, fileKind(st.Mode))
	}
	if st.Size > MaxFileBytes {
		return nil, fmt.Errorf("reading configuration %s: %w (%d bytes, the limit is %d)", path, ErrTooLarge, st.Size, MaxFileBytes)
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("reading configuration: %w", err)
	}
	if len(data) > MaxFileBytes {
		// The file grew after fstat.
		return nil, fmt.Errorf("reading configuration %s: %w (more than %d bytes)", path, ErrTooLarge, MaxFileBytes)
	}
	return data, nil
}

// ErrNotRegular is returned for a configuration path that is not a regular
// file (a FIFO, a device, a directory, a socket).
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is returned for a configuration file over MaxFileBytes.
var ErrTooLarge = errors.New("configuration file too large")

func fileKind(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "FIFO"
	case unix.S_IFCHR:
		return "character device"
	case unix.S_IFBLK:
		return "block device"
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFSOCK:
		return "socket"
	}
	return "special file"
}

// Parse decodes and validates a YAML configuration. With env set,
// BREAKERD_… variables override keys (BREAKERD_ALL_OPEN_DURATION=30s,
// BREAKERD_MODE=shadow, and any key present in the file, such as
// BREAKERD_TARGETS_PAYMENTS_MIN_REQUESTS).
//
// The file must hold exactly one YAML document whose top level is a
// mapping. Keys are case-sensitive; an unknown key, a duplicate key, a
// key with no (null) value, an empty list entry, an alias or merge key, a
// second document, and anything over the limits above are errors, each
// with its key path and line.
func Parse(data []byte, env bool) (*Config, error) {
	d := &decoder{lines: map[string]int{}}
	raw := d.read(data)
	if raw == nil {
		return nil, &ValidationError{Problems: d.problems}
	}
	if env {
		applyEnv(raw)
	}
	return d.decode(raw)
}

// read turns the YAML text into nested map[string]any, []any and scalars,
// recording each key path's line. It returns nil when nothing sensible
// can be decoded (the problems say why).
func (d *decoder) read(data []byte) map[string]any {
	if len(data) > MaxFileBytes {
		d.add("(file)", "%d bytes; the limit is %d", len(data), MaxFileBytes)
		return nil
	}
	// Bound what the YAML parser is handed before it is handed anything.
	text := normalizeBreaks(data)
	if depth, line := nestingDepth(text); depth > MaxDepth {
		d.problems = append(d.problems, Problem{Path: "(file)", Line: line, Msg: fmt.Sprintf("nested more than %d levels deep", MaxDepth)})
		return nil
	}
	if n := entryEstimate(text); n > 2*MaxEntries {
		d.add("(file)", "about %d keys and list entries; the limit is %d", n, MaxEntries)
		return nil
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			d.add("(file)", "empty: no configuration (write at least `mode: enforce` to take every default)")
			return nil
		}
		d.add("(file)", "not valid YAML: %v", err)
		return nil
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		line := extra.Line
		if err != nil {
			d.add("(file)", "a second YAML document that is not valid either: %v", err)
		} else {
			d.problems = append(d.problems, Problem{Path: "(file)", Line: line, Msg: "more than one YAML document; breakerd reads exactly one"})
		}
		return nil
	}
	if len(doc.Content) != 1 {
		d.add("(file)", "empty: no configuration")
		return nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		d.problems = append(d.problems, Problem{Path: "(file)", Line: root.Line, Msg: fmt.Sprintf("the top level must be a mapping of keys (mode, all, targets …), not %s", describe(root))})
		return nil
	}
	entries := 0
	v, ok := d.node(root, "", 1, &entries)
	if !ok || entries > MaxEntries {
		return nil
	}
	m := v.(map[string]any)
	if len(m) == 0 {
		d.add("(file)", "empty mapping: no configuration")
		return nil
	}
	return m
}

func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias"
	case yaml.ScalarNode:
		if n.Tag == "!!null" {
			return "nothing (null)"
		}
		s := n.Value
		if len(s) > 40 {
			s = s[:40] + "…"
		}
		return fmt.Sprintf("the value %q", s)
	}
	return "a " + n.Tag
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// node decodes one YAML node at path; ok is false when the walk must stop
// (a limit was hit).
func (d *decoder) node(n *yaml.Node, path string, depth int, entries *int) (any, bool) {
	if depth > MaxDepth {
		d.at(path, n.Line, "nested more than %d levels deep", MaxDepth)
		return nil, false
	}
	switch n.Kind {
	case yaml.AliasNode:
		d.at(path, n.Line, "aliases (*%s) are not supported; write the value out", n.Value)
		return nil, true
	case yaml.ScalarNode:
		if n.Tag == "!!null" {
			return nil, true
		}
		var v any
		if err := n.Decode(&v); err != nil {
			d.at(path, n.Line, "%v", err)
			return nil, true
		}
		return v, true
	case yaml.SequenceNode:
		list := make([]any, 0, len(n.Content))
		for i, c := range n.Content {
			*entries++
			if *entries > MaxEntries {
				d.at(path, c.Line, "more than %d keys and list entries in the file", MaxEntries)
				return nil, false
			}
			p := fmt.Sprintf("%s[%d]", path, i)
			d.lines[p] = c.Line
			v, ok := d.node(c, p, depth+1, entries)
			if !ok {
				return nil, false
			}
			if v == nil && c.Kind == yaml.ScalarNode {
				d.at(p, c.Line, "empty list entry (null)")
			}
			list = append(list, v)
		}
		return list, true
	case yaml.MappingNode:
		m := make(map[string]any, len(n.Content)/2)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, val := n.Content[i], n.Content[i+1]
			*entries++
			if *entries > MaxEntries {
				d.at(path, k.Line, "more than %d keys and list entries in the file", MaxEntries)
				return nil, false
			}
			if k.Kind != yaml.ScalarNode || k.Tag == "!!null" {
				d.at(path, k.Line, "a key must be a plain name, not %s", describe(k))
				continue
			}
			if k.Tag == "!!merge" {
				d.at(path, k.Line, "merge keys (<<) are not supported; write the keys out")
				continue
			}
			name := keyName(k.Value, k.Line)
			if labelMapRE.MatchString(path) {
				// A label key (app.kubernetes.io/name) as written:
				// checkLabel refuses any key that is not a label's, and
				// only a configuration has this path at all.
				name = k.Value
			}
			p := join(path, name)
			if _, dup := m[name]; dup {
				d.at(p, k.Line, "duplicate key (first at line %d)", d.lines[p])
				continue
			}
			d.lines[p] = k.Line
			v, ok := d.node(val, p, depth+1, entries)
			if !ok {
				return nil, false
			}
			if v == nil && val.Kind == yaml.ScalarNode {
				d.at(p, k.Line, "no value (null); give it one or remove the key")
			}
			m[name] = v
		}
		return m, true
	}
	d.at(path, n.Line, "unexpected YAML node")
	return nil, true
}

// labelMapRE matches the key path of a workload's pod_labels written as a
// mapping, whose keys are label keys (with '/' and '.') kept as written.
var labelMapRE = regexp.MustCompile(`^workloads\[[0-9]+\]\.pod_labels$`)

// keyName is how a key appears in a key path: as written when it could be
// a name, else only its length and line. A file that is not a
// configuration at all (/etc/shadow, say) must not have its lines copied
// into the log. No such key is valid anyway.
func keyName(k string, line int) string {
	if len(k) > 64 || strings.ContainsFunc(k, func(r rune) bool { return r < ' ' || r > '~' || strings.ContainsRune(":$*/\\\"'`", r) }) {
		return fmt.Sprintf("(key of %d bytes on line %d)", len(k), line)
	}
	return k
}

// applyEnv overrides keys with BREAKERD_<PATH> variables (. written as _):
// the top-level keys, every option of `all`, and every key present in the
// file. An empty variable is ignored.
func applyEnv(raw map[string]any) {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(k, "BREAKERD_") && v != "" {
			env[k] = v
		}
	}
	if len(env) == 0 {
		return
	}
	name := func(path string) string { return "BREAKERD_" + strings.ToUpper(strings.ReplaceAll(path, ".", "_")) }
	var paths []string
	for _, f := range topFields {
		paths = append(paths, f.key)
	}
	for _, f := range optionFields {
		paths = append(paths, "all."+f.key)
	}
	var leaves func(m map[string]any, prefix string)
	leaves = func(m map[string]any, prefix string) {
		for k, v := range m {
			if strings.Contains(k, ".") {
				continue
			}
			p := join(prefix, k)
			if sub, ok := v.(map[string]any); ok {
				leaves(sub, p)
				continue
			}
			paths = append(paths, p)
		}
	}
	leaves(raw, "")
	for _, p := range paths {
		v, ok := env[name(p)]
		if !ok {
			continue
		}
		m := raw
		keys := strings.Split(p, ".")
		for _, k := range keys[:len(keys)-1] {
			sub, ok := m[k].(map[string]any)
			if !ok {
				sub = map[string]any{}
				m[k] = sub
			}
			m = sub
		}
		m[keys[len(keys)-1]] = v
	}
}

// normalizeBreaks writes every YAML line break (CR LF, CR, NEL, LS, PS) as
// LF, for the checks on the text: the parser takes them all.
func normalizeBreaks(data []byte) []byte {
	for _, br := range []string{"\r\n", "\r", "\u0085", "\u2028", "\u2029"} {
		if bytes.Contains(data, []byte(br)) {
			data = bytes.ReplaceAll(data, []byte(br), []byte("\n"))
		}
	}
	return data
}

// nestingDepth estimates, without parsing, how deeply the YAML text nests
// mappings and lists, and the line where it is deepest. It counts open
// block levels by indentation, compact list items ("- - x") and flow
// brackets outside quotes and comments. It never underestimates by more
// than half (a list written at its parent key's indentation counts one
// level for two), so a file it passes nests at most 2 × MaxDepth deep
// when the parser sees it, and the decoder's own check is exact.
func nestingDepth(data []byte) (depth, deepestLine int) {
	var stack []int
	flow := 0
	for lineNo, line := range bytes.Split(data, []byte("\n")) {
		i := 0
		for i < len(line) && line[i] == ' ' {
			i++
		}
		if i == len(line) || line[i] == '#' {
			continue
		}
		// Indentation counts even inside a flow collection spanning lines
		// (where it means nothing): an overestimate, never an
		// underestimate, whatever an unbalanced bracket in a string did
		// to the count below.
		for len(stack) > 0 && stack[len(stack)-1] >= i {
			stack = stack[:len(stack)-1]
		}
		stack = append(stack, i)
		// Compact nesting on one line: "- - x", "- a: b", "? x".
		cur := 0
		for i < len(line) && (line[i] == '-' || line[i] == '?') && (i+1 == len(line) || line[i+1] == ' ' || line[i+1] == '\t') {
			cur++
			i++
			for i < len(line) && (line[i] == ' ' || line[i] == '\t') {
				i++
			}
		}
		cur += len(stack)
		peak := flow
		var quote byte
		start := i // where a scalar may begin
	scan:
		for ; i < len(line); i++ {
			c := line[i]
			switch {
			case quote == '"' && c == '\\':
				i++
			case quote != 0:
				if c == quote {
					quote = 0
				}
			case (c == '"' || c == '\'') && quoteMayStart(line, i, start):
				quote = c
			case c == '#' && (i == 0 || line[i-1] == ' ' || line[i-1] == '\t'):
				break scan
			case c == '[' || c == '{':
				flow++
				peak = max(peak, flow)
			case c == ']' || c == '}':
				flow = max(flow-1, 0)
			}
		}
		if cur+peak > depth {
			depth, deepestLine = cur+peak, lineNo+1
		}
	}
	return depth, deepestLine
}

// quoteMayStart reports whether a quote at line[i] opens a quoted scalar:
// at the start of the content, after a space or tab, after a flow
// indicator ([ { ,), or after the colon of a quoted key ("a":"b"). A quote
// inside a plain scalar (x'y, a:'b) opens nothing.
func quoteMayStart(line []byte, i, start int) bool {
	if i == start {
		return true
	}
	switch line[i-1] {
	case ' ', '\t', '[', '{', ',':
		return true
	case ':':
		return i >= 2 && (line[i-2] == '"' || line[i-2] == '\'')
	}
	return false
}

// entryEstimate counts, without parsing, lines and flow separators: an
// upper bound of sorts on keys plus list entries, to refuse a file that
// would make a huge tree before it is built.
func entryEstimate(data []byte) int {
	return bytes.Count(data, []byte("\n")) + bytes.Count(data, []byte(",")) + 1
}

// at records a problem at a line.
func (d *decoder) at(path string, line int, format string, args ...any) {
	if path == "" {
		path = "(file)"
	}
	d.addLine(path, line, fmt.Sprintf(format, args...))
}

func (d *decoder) addLine(path string, line int, msg string) {
	if len(d.problems) >= maxProblems {
		d.dropped++
		return
	}
	d.problems = append(d.problems, Problem{Path: path, Line: line, Msg: msg})
}

// lineOf is the line of a key path, or of its nearest recorded parent.
func (d *decoder) lineOf(path string) int {
	for p := path; p != ""; {
		if l, ok := d.lines[p]; ok {
			return l
		}
		i := strings.LastIndexAny(p, ".[")
		if i < 0 {
			break
		}
		p = p[:i]
	}
	return 0
}
