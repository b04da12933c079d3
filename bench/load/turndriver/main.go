// Command turndriver is the agent turn loop of bench/load/drivers.py ("turns") in Go, so the
// load suite's client costs what ghz costs for Health/Check rather than a Python asyncio client's
// CPU on the same two cores. Each session is one agent: AppendMessages of workload.turn_messages'
// two messages, BuildContext, RecordBaseline of a provider's count of the view (providerTokens); repeated until a
// time or turn bound. With --incoming, the user message goes with BuildContext and both are
// appended after the baseline. One connection, GOMAXPROCS 1 (ghz's --cpus 1 --connections 1).
// Prints the same JSON object as the Python driver (plus "client": "go").
//
//	turndriver --address 127.0.0.1:50051 --sessions s1,s2 --seconds 10 --max-count 5000
//	turndriver --dump 7,3   # the messages of agent 7's turn 3, as JSON (to compare with Python)
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// Status names as Python's grpc.StatusCode spells them (the JSON's "errors" keys).
var codeNames = []string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
	"PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
	"UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
}

const (
	appendCall   = "AppendMessages"
	buildCall    = "BuildContext"
	baselineCall = "RecordBaseline"
	maxMessage   = 64 << 20
)

type quantile struct {
	P50 float64 `json:"p50_ms"`
	P99 float64 `json:"p99_ms"`
}

type report struct {
	Count   int64               `json:"count"`
	Seconds float64             `json:"seconds"`
	RPS     float64             `json:"rps"`
	Latency map[string]quantile `json:"latency"`
	Errors  map[string]int      `json:"errors"`
	Client  string              `json:"client"`
}

func round(v float64, places int) float64 {
	p := math.Pow(10, float64(places))
	return math.Round(v*p) / p
}

// quantiles as drivers.quantiles: the median, and the value at index int(n * 0.99), in ms.
func quantiles(values []float64) quantile {
	if len(values) == 0 {
		return quantile{}
	}
	sort.Float64s(values)
	n := len(values)
	median := values[n/2]
	if n%2 == 0 {
		median = (values[n/2-1] + values[n/2]) / 2
	}
	return quantile{P50: round(median*1000, 3), P99: round(values[min(n-1, int(float64(n)*0.99))]*1000, 3)}
}

func codeName(err error) string {
	c := int(status.Code(err))
	if c >= 0 && c < len(codeNames) {
		return codeNames[c]
	}
	return strconv.Itoa(c)
}

type loop struct {
	stub     pb.ContextServiceClient
	deadline time.Time
	maxTurns int64
	tokens   int64
	// incoming: the user message goes with BuildContext, and both messages are appended after
	// the baseline (an agent that builds before it stores)
	incoming bool
	done     atomic.Int64
	mu       sync.Mutex
	lat      map[string][]float64
	errors   map[string]int
}

func (l *loop) fail(err error) {
	l.mu.Lock()
	l.errors[codeName(err)]++
	l.mu.Unlock()
}

func (l *loop) agent(ctx context.Context, k int, sid string) {
	var mine [3][]float64
	for turn := uint64(1); time.Now().Before(l.deadline) && l.done.Load() < l.maxTurns; turn++ {
		msgs := turnMessages(uint64(k)*100_000 + turn)
		store := func() (float64, error) {
			t := time.Now()
			_, err := l.stub.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: sid, Messages: msgs})
			return time.Since(t).Seconds(), err
		}
		build := &pb.BuildContextRequest{SessionId: sid}
		var appended float64
		var err error
		if l.incoming {
			build.Incoming = msgs[0]
		} else if appended, err = store(); err != nil {
			l.fail(err)
			continue
		}
		t1 := time.Now()
		built, err := l.stub.BuildContext(ctx, build)
		if err != nil {
			l.fail(err)
			continue
		}
		t2 := time.Now()
		count := l.tokens
		if count == 0 {
			count = providerTokens(built.GetMessages())
		}
		req := &pb.RecordBaselineRequest{SessionId: sid, ViewId: built.GetViewId(), PromptTokens: count}
		if _, err := l.stub.RecordBaseline(ctx, req); err != nil {
			l.fail(err)
			continue
		}
		t3 := time.Now()
		if l.incoming { // both messages stored once the model answered
			if appended, err = store(); err != nil {
				l.fail(err)
				continue
			}
		}
		mine[0] = append(mine[0], appended)
		mine[1] = append(mine[1], t2.Sub(t1).Seconds())
		mine[2] = append(mine[2], t3.Sub(t2).Seconds())
		l.done.Add(1)
	}
	l.mu.Lock()
	for i, name := range []string{appendCall, buildCall, baselineCall} {
		l.lat[name] = append(l.lat[name], mine[i]...)
	}
	l.mu.Unlock()
}

// providerTokens is what a provider's tokenizer counts for the view: a fixed function of its
// text (a token per 4 bytes, 4 per message of framing, workload.provider_tokens). A count derived
// from the service's own estimate (say 5 % above it) would compound through baseline + delta,
// the estimate growing 5 % a turn until the session compacts in the middle of the run.
func providerTokens(messages []*pb.Message) int64 {
	var n int64 = 3
	for _, m := range messages {
		n += int64(len(m.GetContent()))/4 + 4
	}
	return n
}

func run(address string, sessions []string, seconds float64, maxTurns, tokens int64, window int32, incoming bool) (*report, error) {
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessage), grpc.MaxCallSendMsgSize(maxMessage)),
	}
	if window > 0 { // a fixed HTTP/2 window (grpc-go then sends no BDP pings)
		opts = append(opts, grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window))
	}
	conn, err := grpc.NewClient(address, opts...)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	l := &loop{
		stub:     pb.NewContextServiceClient(conn),
		deadline: time.Now().Add(time.Duration(seconds * float64(time.Second))),
		maxTurns: maxTurns,
		incoming: incoming,
		tokens:   tokens,
		lat:      map[string][]float64{appendCall: nil, buildCall: nil, baselineCall: nil},
		errors:   map[string]int{},
	}
	ctx := context.Background()
	started := time.Now()
	var wg sync.WaitGroup
	for k, sid := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.agent(ctx, k, sid)
		}()
	}
	wg.Wait()
	elapsed := time.Since(started).Seconds()
	done := l.done.Load()
	out := &report{
		Count:   done,
		Seconds: round(elapsed, 3),
		Latency: map[string]quantile{},
		Errors:  l.errors,
		Client:  "go",
	}
	if elapsed > 0 {
		out.RPS = round(float64(done)/elapsed, 2)
	}
	for name, v := range l.lat {
		out.Latency[name] = quantiles(v)
	}
	return out, nil
}

type dumped struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func dump(spec string) error {
	agent, turn, ok := strings.Cut(spec, ",")
	if !ok {
		return fmt.Errorf("--dump wants AGENT,TURN, got %q", spec)
	}
	k, err := strconv.ParseUint(agent, 10, 32)
	if err != nil {
		return err
	}
	t, err := strconv.ParseUint(turn, 10, 32)
	if err != nil {
		return err
	}
	var out []dumped
	for _, m := range turnMessages(k*100_000 + t) {
		out = append(out, dumped{Role: m.GetRole().String(), Content: m.GetContent()})
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

func main() {
	address := flag.String("address", "", "server address (host:port)")
	sessions := flag.String("sessions", "", "comma-separated session ids, one agent each")
	seconds := flag.Float64("seconds", 10, "time bound")
	maxCount := flag.Int64("max-count", 10_000, "turn bound (all agents together)")
	tokens := flag.Int64("prompt-tokens", 0, "prompt tokens to record (0: providerTokens of the view)")
	cpus := flag.Int("cpus", 1, "GOMAXPROCS")
	window := flag.Int("window", 0, "fixed HTTP/2 window in bytes (0: grpc-go's dynamic window)")
	dumpSpec := flag.String("dump", "", "print the messages of AGENT,TURN and exit")
	incoming := flag.Bool("incoming", false, "send the user message with BuildContext; append both after the baseline")
	flag.Parse()
	if *dumpSpec != "" {
		if err := dump(*dumpSpec); err != nil {
			fmt.Fprintln(os.Stderr, "turndriver:", err)
			os.Exit(2)
		}
		return
	}
	if *address == "" || *sessions == "" {
		fmt.Fprintln(os.Stderr, "turndriver: --address and --sessions are required")
		os.Exit(2)
	}
	runtime.GOMAXPROCS(*cpus)
	out, err := run(*address, strings.Split(*sessions, ","), *seconds, *maxCount, *tokens, int32(*window), *incoming)
	if err != nil {
		fmt.Fprintln(os.Stderr, "turndriver:", err)
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
