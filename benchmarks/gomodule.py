"""The Go workload of the cold-read benchmark: a Debian tree with the Go
toolchain (debootstrap minbase + golang-go, built once into the tests'
cache) and a small Go module written into a copy of it, with a few packages
and their tests, that needs no downloads (standard library only, GOPROXY
off, GOFLAGS=-mod=mod): `go test ./...` in it compiles the packages and
links a test binary per package against the toolchain's precompiled
standard library, reading from the image the way a user's first `go test`
in a fresh sandbox does.

    root = go_tree()                    # the toolchain tree (cached)
    write_module(tree_copy)             # /src/calc in the copy
    argv, env = go_test_command("/tmp/gocache-1")   # run chrooted
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks.bench_erofs import CACHE_ROOT
from benchmarks.report import log

MODULE_DIR = "/src/calc"

_FILES = {
    "go.mod": """\
        module example.com/calc

        go 1.19
        """,
    "arith/arith.go": """\
        // Package arith does integer arithmetic with overflow checks.
        package arith

        import (
        	"errors"
        	"math"
        )

        var ErrOverflow = errors.New("overflow")

        func Add(a, b int64) (int64, error) {
        	if (b > 0 && a > math.MaxInt64-b) || (b < 0 && a < math.MinInt64-b) {
        		return 0, ErrOverflow
        	}
        	return a + b, nil
        }

        func Mul(a, b int64) (int64, error) {
        	if a == 0 || b == 0 {
        		return 0, nil
        	}
        	c := a * b
        	if c/b != a {
        		return 0, ErrOverflow
        	}
        	return c, nil
        }

        func GCD(a, b int64) int64 {
        	for b != 0 {
        		a, b = b, a%b
        	}
        	if a < 0 {
        		return -a
        	}
        	return a
        }
        """,
    "arith/arith_test.go": """\
        package arith

        import (
        	"math"
        	"testing"
        )

        func TestAdd(t *testing.T) {
        	if got, err := Add(2, 3); err != nil || got != 5 {
        		t.Fatalf("Add(2, 3) = %d, %v", got, err)
        	}
        	if _, err := Add(math.MaxInt64, 1); err != ErrOverflow {
        		t.Fatalf("want overflow, got %v", err)
        	}
        }

        func TestMul(t *testing.T) {
        	if got, _ := Mul(-4, 6); got != -24 {
        		t.Fatalf("Mul(-4, 6) = %d", got)
        	}
        	if _, err := Mul(math.MaxInt64, 2); err != ErrOverflow {
        		t.Fatalf("want overflow, got %v", err)
        	}
        }

        func TestGCD(t *testing.T) {
        	for _, c := range []struct{ a, b, want int64 }{{12, 18, 6}, {-9, 6, 3}, {7, 0, 7}} {
        		if got := GCD(c.a, c.b); got != c.want {
        			t.Errorf("GCD(%d, %d) = %d, want %d", c.a, c.b, got, c.want)
        		}
        	}
        }
        """,
    "expr/expr.go": """\
        // Package expr evaluates integer expressions: + - * / and parentheses.
        package expr

        import (
        	"fmt"
        	"strconv"
        	"strings"
        	"unicode"

        	"example.com/calc/arith"
        )

        type parser struct {
        	toks []string
        	pos  int
        }

        func tokenize(s string) ([]string, error) {
        	var toks []string
        	for i := 0; i < len(s); {
        		c := rune(s[i])
        		switch {
        		case unicode.IsSpace(c):
        			i++
        		case strings.ContainsRune("+-*/()", c):
        			toks = append(toks, string(c))
        			i++
        		case unicode.IsDigit(c):
        			j := i
        			for j < len(s) && unicode.IsDigit(rune(s[j])) {
        				j++
        			}
        			toks = append(toks, s[i:j])
        			i = j
        		default:
        			return nil, fmt.Errorf("unexpected %q at %d", c, i)
        		}
        	}
        	return toks, nil
        }

        // Eval evaluates s.
        func Eval(s string) (int64, error) {
        	toks, err := tokenize(s)
        	if err != nil {
        		return 0, err
        	}
        	p := &parser{toks: toks}
        	v, err := p.sum()
        	if err == nil && p.pos != len(p.toks) {
        		err = fmt.Errorf("trailing %q", p.toks[p.pos])
        	}
        	return v, err
        }

        func (p *parser) peek() string {
        	if p.pos < len(p.toks) {
        		return p.toks[p.pos]
        	}
        	return ""
        }

        func (p *parser) sum() (int64, error) {
        	v, err := p.product()
        	for err == nil && (p.peek() == "+" || p.peek() == "-") {
        		op := p.toks[p.pos]
        		p.pos++
        		var w int64
        		if w, err = p.product(); err == nil {
        			if op == "-" {
        				w = -w
        			}
        			v, err = arith.Add(v, w)
        		}
        	}
        	return v, err
        }

        func (p *parser) product() (int64, error) {
        	v, err := p.atom()
        	for err == nil && (p.peek() == "*" || p.peek() == "/") {
        		op := p.toks[p.pos]
        		p.pos++
        		var w int64
        		if w, err = p.atom(); err == nil {
        			if op == "*" {
        				v, err = arith.Mul(v, w)
        			} else if w == 0 {
        				err = fmt.Errorf("division by zero")
        			} else {
        				v /= w
        			}
        		}
        	}
        	return v, err
        }

        func (p *parser) atom() (int64, error) {
        	t := p.peek()
        	p.pos++
        	switch {
        	case t == "(":
        		v, err := p.sum()
        		if err == nil && p.peek() != ")" {
        			err = fmt.Errorf("missing )")
        		}
        		p.pos++
        		return v, err
        	case t == "-":
        		v, err := p.atom()
        		return -v, err
        	case t != "":
        		return strconv.ParseInt(t, 10, 64)
        	}
        	return 0, fmt.Errorf("unexpected end")
        }
        """,
    "expr/expr_test.go": """\
        package expr

        import "testing"

        func TestEval(t *testing.T) {
        	cases := map[string]int64{"1+2*3": 7, "(1+2)*3": 9, "-4/2": -2, " 10 - 3 - 2 ": 5}
        	for in, want := range cases {
        		if got, err := Eval(in); err != nil || got != want {
        			t.Errorf("Eval(%q) = %d, %v; want %d", in, got, err, want)
        		}
        	}
        	for _, bad := range []string{"1+", "2*(3", "4/0", "x"} {
        		if _, err := Eval(bad); err == nil {
        			t.Errorf("Eval(%q): no error", bad)
        		}
        	}
        }
        """,
    "ledger/ledger.go": """\
        // Package ledger keeps named balances and saves them as JSON.
        package ledger

        import (
        	"encoding/json"
        	"io"
        	"sort"
        	"sync"
        )

        type Ledger struct {
        	mu       sync.Mutex
        	Balances map[string]int64 `json:"balances"`
        }

        func New() *Ledger { return &Ledger{Balances: map[string]int64{}} }

        func (l *Ledger) Move(from, to string, amount int64) {
        	l.mu.Lock()
        	defer l.mu.Unlock()
        	l.Balances[from] -= amount
        	l.Balances[to] += amount
        }

        func (l *Ledger) Names() []string {
        	l.mu.Lock()
        	defer l.mu.Unlock()
        	names := make([]string, 0, len(l.Balances))
        	for n := range l.Balances {
        		names = append(names, n)
        	}
        	sort.Strings(names)
        	return names
        }

        func (l *Ledger) Save(w io.Writer) error { return json.NewEncoder(w).Encode(l) }

        func Load(r io.Reader) (*Ledger, error) {
        	l := New()
        	return l, json.NewDecoder(r).Decode(l)
        }
        """,
    "ledger/ledger_test.go": """\
        package ledger

        import (
        	"bytes"
        	"reflect"
        	"sync"
        	"testing"
        )

        func TestMoveSaveLoad(t *testing.T) {
        	l := New()
        	var wg sync.WaitGroup
        	for i := 0; i < 50; i++ {
        		wg.Add(1)
        		go func() { defer wg.Done(); l.Move("a", "b", 2) }()
        	}
        	wg.Wait()
        	var buf bytes.Buffer
        	if err := l.Save(&buf); err != nil {
        		t.Fatal(err)
        	}
        	m, err := Load(&buf)
        	if err != nil {
        		t.Fatal(err)
        	}
        	if !reflect.DeepEqual(m.Balances, map[string]int64{"a": -100, "b": 100}) {
        		t.Fatalf("loaded %v", m.Balances)
        	}
        	if got := m.Names(); !reflect.DeepEqual(got, []string{"a", "b"}) {
        		t.Fatalf("names %v", got)
        	}
        }
        """,
    "report/report.go": """\
        // Package report renders a ledger as an aligned text table.
        package report

        import (
        	"fmt"
        	"strings"
        	"text/tabwriter"

        	"example.com/calc/ledger"
        )

        func Render(l *ledger.Ledger) string {
        	var b strings.Builder
        	w := tabwriter.NewWriter(&b, 0, 4, 2, ' ', tabwriter.AlignRight)
        	for _, n := range l.Names() {
        		fmt.Fprintf(w, "%s\\t%d\\t\\n", n, l.Balances[n])
        	}
        	w.Flush()
        	return b.String()
        }
        """,
    "report/report_test.go": """\
        package report

        import (
        	"strings"
        	"testing"

        	"example.com/calc/ledger"
        )

        func TestRender(t *testing.T) {
        	l := ledger.New()
        	l.Move("alice", "bob", 42)
        	out := Render(l)
        	if !strings.Contains(out, "alice") || !strings.Contains(out, "-42") {
        		t.Fatalf("render: %q", out)
        	}
        }
        """,
}


def go_tree() -> Path:
    """The Go toolchain tree (bookworm minbase + golang-go), built once."""
    root = CACHE_ROOT / "debian-go"
    if not (root / "usr/bin/go").exists():
        log(f"building {root} with debootstrap (a few minutes, once)")
        from tests.test_lazyfs_debian import _debootstrap
        return _debootstrap("debian-go", "golang-go", "usr/bin/go")
    return root


def write_module(root: Path) -> Path:
    """The module's sources at MODULE_DIR under root; returns that directory."""
    top = root / MODULE_DIR.lstrip("/")
    for rel, text in _FILES.items():
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return top


def go_test_command(gocache: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment of `go test ./...` in the module, run chrooted;
    `gocache` is a fresh build cache directory (so every run compiles)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LC_ALL": "C", "GOCACHE": gocache, "GOPATH": "/tmp/gopath",
           "GOPROXY": "off", "GOFLAGS": "-mod=mod", "GOTELEMETRY": "off"}
    return ["sh", "-c", f"cd {MODULE_DIR} && go test -count=1 ./..."], env
