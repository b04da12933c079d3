package contextsvc_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	contextsvc "github.com/contextsvc/contextsvc/clients/go"
	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

var serverAddr string

var fast = contextsvc.RetryPolicy{MaxAttempts: 8, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, MaxReconnects: 20}

// grpc-go waits a second before reconnecting by default; tests shorten it so a restored port is found.
var quickReconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, MaxDelay: 200 * time.Millisecond},
	MinConnectTimeout: time.Second,
})

// TestMain starts one real `python3 -m contextsvc serve --store memory` from the repository root.
func TestMain(m *testing.M) {
	addr, cmd, err := startServer(nil)
	if err != nil {
		panic(err)
	}
	serverAddr = addr
	code := m.Run()
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	os.Exit(code)
}

// startServer runs `python3 -m contextsvc serve --listen 127.0.0.1:0 --store memory` from the
// repository root with env (CONTEXTSVC_* settings) added, and returns the address it listens on.
func startServer(env []string) (string, *exec.Cmd, error) {
	python := os.Getenv("PYTHON")
	if python == "" {
		python = "python3"
	}
	cmd := exec.Command(python, "-m", "contextsvc", "serve", "--listen", "127.0.0.1:0", "--store", "memory")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	found := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`contextsvc listening on (\S+):(\d+)`)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				found <- m[1] + ":" + m[2]
			}
		}
	}()
	select {
	case addr := <-found:
		return addr, cmd, nil
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return "", nil, errors.New("server did not start")
	}
}

// startQuotaServer starts a server of its own for one test, with CONTEXTSVC_QUOTAS__<FIELD>
// settings (every loopback caller is the same user, so the quota is the test's alone).
func startQuotaServer(t *testing.T, env ...string) string {
	t.Helper()
	addr, cmd, err := startServer(env)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return addr
}

func newClient(t *testing.T, target string, opts contextsvc.Options) *contextsvc.Client {
	t.Helper()
	opts.DialOptions = append(opts.DialOptions, quickReconnect)
	c, err := contextsvc.New(target, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func user(text string) *pb.Message { return &pb.Message{Role: pb.Role_ROLE_USER, Content: text} }

func TestEveryRPC(t *testing.T) {
	ctx := context.Background()
	c := newClient(t, serverAddr, contextsvc.Options{Retry: fast})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{Name: "demo"})
	if err != nil {
		t.Fatal(err)
	}
	app, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user("read main.py"), user("and tests")}})
	if err != nil || len(app.SequenceNumbers) != 2 || app.SequenceNumbers[1] != 2 {
		t.Fatalf("append: %v %v", app, err)
	}
	view, err := c.BuildContext(ctx, &pb.BuildContextRequest{SessionId: s.Id, Profile: &pb.Profile{Model: ptr("m"), SystemPrompt: ptr("be brief")}})
	if err != nil || view.Messages[0].Content != "be brief" || view.ViewId == "" {
		t.Fatalf("build: %v %v", view, err)
	}
	rec, err := c.RecordBaseline(ctx, &pb.RecordBaselineRequest{SessionId: s.Id, ViewId: view.ViewId, PromptTokens: view.Estimate.Total})
	if err != nil || !rec.Recorded {
		t.Fatalf("baseline: %v %v", rec, err)
	}
	fork, err := c.ForkSession(ctx, &pb.ForkSessionRequest{SessionId: s.Id, AtSequence: 1})
	if err != nil || fork.DisplayMessageCount != 1 {
		t.Fatalf("fork: %v %v", fork, err)
	}
	if _, err := c.DeleteSession(ctx, &pb.DeleteSessionRequest{SessionId: fork.Id}); err != nil {
		t.Fatal(err)
	}
	_, err = c.GetSession(ctx, &pb.GetSessionRequest{SessionId: fork.Id})
	if !errors.Is(err, contextsvc.ErrNotFound) {
		t.Fatalf("want ErrNotFound, got %v", err)
	}
}

// A message at the server's content limit (4 Mi characters) is over grpc-go's default 4 MiB
// receive limit: the client still reads it back.
func TestAMessageAtTheContentLimitCanBeReadBack(t *testing.T) {
	ctx := context.Background()
	c := newClient(t, serverAddr, contextsvc.Options{})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{Name: "big"})
	if err != nil {
		t.Fatal(err)
	}
	content := strings.Repeat("a", 4<<20)
	if _, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user(content)}}); err != nil {
		t.Fatal(err)
	}
	page, err := c.ListMessages(ctx, &pb.ListMessagesRequest{SessionId: s.Id, PageSize: 1})
	if err != nil || len(page.Messages) != 1 || page.Messages[0].Content != content {
		t.Fatalf("list: %v", err)
	}
}

func TestTypedErrors(t *testing.T) {
	ctx := context.Background()
	c := newClient(t, serverAddr, contextsvc.Options{})
	s, _ := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	_, err := c.Compress(ctx, &pb.CompressRequest{SessionId: s.Id})
	var typed *contextsvc.Error
	if !errors.Is(err, contextsvc.ErrNothingToCompact) || !errors.Is(err, contextsvc.ErrFailedPrecondition) ||
		errors.Is(err, contextsvc.ErrContextTooLarge) || !errors.As(err, &typed) {
		t.Fatalf("want NothingToCompact, got %v", err)
	}
	if typed.Reason != "NOTHING_TO_COMPACT" || typed.Domain != "contextsvc.dev" || typed.Code != codes.FailedPrecondition {
		t.Fatalf("details: %+v", typed)
	}
	_, err = c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user("x"), {Content: "no role"}}})
	if !errors.As(err, &typed) || !errors.Is(err, contextsvc.ErrInvalidArgument) || len(typed.Violations) == 0 {
		t.Fatalf("want InvalidArgument with violations, got %v", err)
	}
	if errors.Is(err, contextsvc.ErrRequestIDReused) {
		t.Fatalf("a bad message is not a reused request id: %v", err)
	}
	// The same request id with other messages: its own sentinel, as the Python client's RequestIdReused.
	req := &pb.AppendMessagesRequest{SessionId: s.Id, RequestId: "turn-1", Messages: []*pb.Message{user("x")}}
	if _, err := c.AppendMessages(ctx, req); err != nil {
		t.Fatal(err)
	}
	req.Messages = []*pb.Message{user("y")}
	_, err = c.AppendMessages(ctx, req)
	if !errors.Is(err, contextsvc.ErrRequestIDReused) || !errors.Is(err, contextsvc.ErrInvalidArgument) {
		t.Fatalf("want ErrRequestIDReused, got %v", err)
	}
}

func TestDeadline(t *testing.T) {
	c := newClient(t, serverAddr, contextsvc.Options{Timeout: time.Microsecond})
	_, err := c.ListSessions(context.Background(), &pb.ListSessionsRequest{})
	var typed *contextsvc.Error
	if !errors.As(err, &typed) || typed.Code != codes.DeadlineExceeded {
		t.Fatalf("want DEADLINE_EXCEEDED, got %v", err)
	}
}

func TestBearerToken(t *testing.T) {
	var seen string
	values := 0
	spy := grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		md, _ := metadata.FromOutgoingContext(ctx)
		values = len(md.Get("authorization"))
		if values > 0 {
			seen = md.Get("authorization")[0]
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	c := newClient(t, serverAddr, contextsvc.Options{Token: "t0ken", DialOptions: []grpc.DialOption{spy}})
	if _, err := c.CreateSession(context.Background(), &pb.CreateSessionRequest{}); err != nil {
		t.Fatal(err)
	}
	if seen != "Bearer t0ken" {
		t.Fatalf("authorization header = %q", seen)
	}
	// A token read from a file (a mounted secret) ends with a newline: grpc-go refused the header
	// as INTERNAL. Node's Headers trim it; so does every client.
	c = newClient(t, serverAddr, contextsvc.Options{Token: "t0ken\n", DialOptions: []grpc.DialOption{spy}})
	if _, err := c.CreateSession(context.Background(), &pb.CreateSessionRequest{}); err != nil {
		t.Fatal(err)
	}
	if seen != "Bearer t0ken" {
		t.Fatalf("authorization header = %q", seen)
	}
	// A call whose context carries its own authorization sends that one alone: two values are
	// refused by the service (TOKEN_INVALID).
	own := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer per-call")
	if _, err := c.ListSessions(own, &pb.ListSessionsRequest{}); err != nil && !errors.Is(err, contextsvc.ErrUnauthenticated) {
		t.Fatal(err)
	}
	if seen != "Bearer per-call" || values != 1 {
		t.Fatalf("authorization header = %q (%d values)", seen, values)
	}
}

// A token no header can carry is a wrong token, as the service and the gateway call it: grpc-go
// refused the header as INTERNAL, blaming the service.
func TestATokenNoHeaderCanCarryIsUnauthenticated(t *testing.T) {
	ctx := context.Background()
	for _, token := range []string{"t\u00f6ken", "tok\x00en"} {
		c := newClient(t, serverAddr, contextsvc.Options{Token: token})
		_, err := c.ListSessions(ctx, &pb.ListSessionsRequest{})
		var typed *contextsvc.Error
		if !errors.As(err, &typed) || !errors.Is(err, contextsvc.ErrUnauthenticated) || typed.Reason != "TOKEN_INVALID" {
			t.Fatalf("%q: want ErrUnauthenticated TOKEN_INVALID, got %v", token, err)
		}
		for _, err := range c.Events(ctx, "", 0) {
			if !errors.Is(err, contextsvc.ErrUnauthenticated) {
				t.Fatalf("%q: events: want ErrUnauthenticated, got %v", token, err)
			}
			break
		}
		// A call carrying its own token sends that one, not the client's.
		own := metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer per-call")
		if _, err := c.ListSessions(own, &pb.ListSessionsRequest{}); err != nil {
			t.Fatalf("%q: a call with its own token: %v", token, err)
		}
	}
}

func TestRetriesUnavailableAndRequestIDs(t *testing.T) {
	ctx := context.Background()
	p := startProxy(t, serverAddr)
	c := newClient(t, p.addr, contextsvc.Options{Retry: fast, Timeout: 10 * time.Second})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	p.stopListening()
	time.AfterFunc(400*time.Millisecond, p.listen)
	req := &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user("after the outage")}}
	app, err := c.AppendMessages(ctx, req)
	if err != nil || app.SequenceNumbers[0] != 1 {
		t.Fatalf("append through the outage: %v %v", app, err)
	}
	if req.RequestId != "" {
		t.Fatalf("the caller's request was given a request id: %q", req.RequestId)
	}
	req.RequestId = "0b7c6f1e-4d1a-4c55-9a3e-2f7d8c1b9e40" // the caller's own id: a replay is applied once
	first, err := c.AppendMessages(ctx, req)
	if err != nil || first.SequenceNumbers[0] != 2 {
		t.Fatalf("append with a request id: %v %v", first, err)
	}
	again, err := c.AppendMessages(ctx, req)
	if err != nil || again.SequenceNumbers[0] != 2 {
		t.Fatalf("replayed append: %v %v", again, err)
	}
	p.stopListening()
	once := newClient(t, p.addr, contextsvc.Options{Retry: contextsvc.RetryPolicy{MaxAttempts: 1}})
	if _, err := once.GetSession(ctx, &pb.GetSessionRequest{SessionId: s.Id}); !errors.Is(err, contextsvc.ErrUnavailable) {
		t.Fatalf("want ErrUnavailable, got %v", err)
	}
}

// Without the tests' quickReconnect: grpc-go's default reconnect backoff (1 s, growing) must not
// fail the retries of a call made right after a server that was down for a few seconds is back.
func TestRetriesReachAServerBackAfterAnOutageWithDefaultReconnects(t *testing.T) {
	ctx := context.Background()
	p := startProxy(t, serverAddr)
	c, err := contextsvc.New(p.addr, contextsvc.Options{Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	p.stopListening()
	p.drop()
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); {
		_, _ = c.GetSession(ctx, &pb.GetSessionRequest{SessionId: s.Id}) // fails: the channel backs off
		time.Sleep(100 * time.Millisecond)
	}
	p.listen()
	if _, err := c.GetSession(ctx, &pb.GetSessionRequest{SessionId: s.Id}); err != nil {
		t.Fatalf("a call right after the outage: %v", err)
	}
}

func TestNotIdempotentCallsAreNotRetriedOnABareUnavailable(t *testing.T) {
	ctx := context.Background()
	p := startProxy(t, serverAddr)
	c := newClient(t, p.addr, contextsvc.Options{Retry: fast, Timeout: 10 * time.Second})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	p.stopListening()
	// Back after 1 s: a retried call would get through; CreateSession and ForkSession must not.
	time.AfterFunc(time.Second, p.listen)
	if _, err := c.CreateSession(ctx, &pb.CreateSessionRequest{}); !errors.Is(err, contextsvc.ErrUnavailable) {
		t.Fatalf("CreateSession: want ErrUnavailable at once, got %v", err)
	}
	if _, err := c.ForkSession(ctx, &pb.ForkSessionRequest{SessionId: s.Id}); !errors.Is(err, contextsvc.ErrUnavailable) {
		t.Fatalf("ForkSession: want ErrUnavailable at once, got %v", err)
	}
	// An idempotent call in the same outage waits it out.
	if got, err := c.GetSession(ctx, &pb.GetSessionRequest{SessionId: s.Id}); err != nil || got.Id != s.Id {
		t.Fatalf("GetSession through the outage: %v %v", got, err)
	}
}

func TestEventsResumeAfterADroppedStream(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := newClient(t, serverAddr, contextsvc.Options{})
	p := startProxy(t, serverAddr)
	watcher := newClient(t, p.addr, contextsvc.Options{Retry: fast})
	s, _ := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	var mu sync.Mutex
	var seen []*pb.Event
	done := make(chan error, 1)
	go func() {
		for ev, err := range watcher.Events(ctx, s.Id, 0) {
			if err != nil {
				done <- err
				return
			}
			mu.Lock()
			seen = append(seen, ev)
			mu.Unlock()
		}
		done <- nil
	}()
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(seen) }
	time.Sleep(300 * time.Millisecond)
	for i := 0; i < 3; i++ {
		if _, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user("m")}}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, func() bool { return count() == 3 })
	p.drop()
	for i := 0; i < 3; i++ {
		if _, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user("m")}}); err != nil {
			t.Fatal(err)
		}
	}
	p.drop()
	waitFor(t, func() bool { return count() == 6 })
	if _, err := c.DeleteSession(ctx, &pb.DeleteSessionRequest{SessionId: s.Id}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(seen) != 7 || seen[6].GetSessionDeleted() == nil {
		t.Fatalf("want 6 appends and a deletion, got %d events", len(seen))
	}
	for i, ev := range seen[:6] {
		if got := ev.GetMessagesAppended().GetSequenceNumbers()[0]; got != int64(i+1) {
			t.Fatalf("event %d has sequence %d: a gap or a duplicate", i, got)
		}
		if ev.EventId >= seen[i+1].EventId {
			t.Fatal("event ids not increasing")
		}
	}
}

func TestEventsGiveUpAfterTheReconnectCap(t *testing.T) {
	p := startProxy(t, serverAddr)
	p.stopListening()
	c := newClient(t, p.addr, contextsvc.Options{Retry: contextsvc.RetryPolicy{InitialBackoff: 10 * time.Millisecond, MaxBackoff: 20 * time.Millisecond, MaxReconnects: 3}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, err := range c.Events(ctx, "", 0) {
		if !errors.Is(err, contextsvc.ErrUnavailable) {
			t.Fatalf("want ErrUnavailable, got %v", err)
		}
		return
	}
	t.Fatal("iterator ended without an error")
}

// Reusing one request struct across turns appends every turn: the client never writes its
// generated request id into the caller's request.
func TestAppendMessagesLeavesTheCallersRequestAlone(t *testing.T) {
	ctx := context.Background()
	c := newClient(t, serverAddr, contextsvc.Options{})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	req := &pb.AppendMessagesRequest{SessionId: s.Id}
	for i, text := range []string{"turn one", "turn two", "turn two"} { // the same content twice: two messages
		req.Messages = []*pb.Message{user(text)}
		app, err := c.AppendMessages(ctx, req)
		if err != nil || app.SequenceNumbers[0] != int64(i+1) {
			t.Fatalf("append %d of a reused request: %v %v", i+1, app, err)
		}
	}
	if req.RequestId != "" {
		t.Fatalf("the client wrote request id %q into the caller's request", req.RequestId)
	}
	list, err := c.ListMessages(ctx, &pb.ListMessagesRequest{SessionId: s.Id, Buffer: pb.Buffer_BUFFER_DISPLAY})
	if err != nil || len(list.Messages) != 3 {
		t.Fatalf("want 3 messages stored, got %v %v", list, err)
	}
}

// A retried append carries the one request id generated for the call, so an attempt whose reply
// was lost is applied once.
func TestAppendMessagesRetryKeepsItsRequestID(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex
	var ids []string
	loseFirstReply := grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		r, ok := req.(*pb.AppendMessagesRequest)
		if !ok {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		mu.Lock()
		ids = append(ids, r.GetRequestId())
		first := len(ids) == 1
		mu.Unlock()
		err := invoker(ctx, method, req, reply, cc, opts...)
		if first && err == nil {
			return status.Error(codes.Unavailable, "reply lost")
		}
		return err
	})
	c := newClient(t, serverAddr, contextsvc.Options{Retry: fast, DialOptions: []grpc.DialOption{loseFirstReply}})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	req := &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{user("once")}}
	app, err := c.AppendMessages(ctx, req)
	if err != nil || app.SequenceNumbers[0] != 1 {
		t.Fatalf("append: %v %v", app, err)
	}
	if len(ids) != 2 || len(ids[0]) != 36 || ids[0] != ids[1] {
		t.Fatalf("want two attempts with one generated request id, got %q", ids)
	}
	if req.RequestId != "" {
		t.Fatalf("the caller's request was given request id %q", req.RequestId)
	}
	list, err := c.ListMessages(ctx, &pb.ListMessagesRequest{SessionId: s.Id, Buffer: pb.Buffer_BUFFER_DISPLAY})
	if err != nil || len(list.Messages) != 1 {
		t.Fatalf("want the retried append applied once, got %v %v", list, err)
	}
}

// Breaking out of the range loop closes the stream, even though ctx lives on: with a quota of one
// open stream per user, opening Events again and again must keep working.
func TestEventsClosesTheStreamWhenTheLoopBreaks(t *testing.T) {
	addr := startQuotaServer(t, "CONTEXTSVC_QUOTAS__STREAMS_PER_USER=1")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := newClient(t, addr, contextsvc.Options{Retry: fast})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var first int64
	seen := make(chan struct{})
	go func() {
		for ev, err := range c.Events(ctx, s.Id, 0) {
			if err != nil {
				t.Error(err)
			} else {
				first = ev.EventId
			}
			break // ctx lives on: the stream must close all the same
		}
		close(seen)
	}()
	appendUntil(t, ctx, c, s.Id, seen)
	if first == 0 {
		t.Fatal("no event")
	}
	for i := 0; i < 5; i++ {
		// The server frees a closed stream's slot a moment after the client cancels it.
		deadline := time.Now().Add(5 * time.Second)
		for got := false; !got; {
			if time.Now().After(deadline) {
				t.Fatalf("reopening Events (%d): no event", i)
			}
			for ev, err := range c.Events(ctx, s.Id, first-1) {
				if errors.Is(err, contextsvc.ErrResourceExhausted) && time.Now().Before(deadline) {
					time.Sleep(20 * time.Millisecond)
					break
				}
				if err != nil {
					t.Fatalf("reopening Events (%d): the broken-off stream is still open: %v", i, err)
				}
				if ev.EventId != first {
					t.Fatalf("want event %d replayed, got %d", first, ev.EventId)
				}
				got = true
				break
			}
		}
	}
}

// appendUntil appends a message to session sid every 100 ms until done is closed (a live-only
// Events call sees an event only once its stream is open).
func appendUntil(t *testing.T, ctx context.Context, c *contextsvc.Client, sid string, done <-chan struct{}) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case <-done:
			return
		case <-timeout:
			t.Fatal("no event seen")
		case <-time.After(100 * time.Millisecond):
		}
		if _, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: sid, Messages: []*pb.Message{user("m")}}); err != nil {
			t.Fatal(err)
		}
	}
}

func ptr[T any](v T) *T { return &v }

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	end := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(end) {
			t.Fatal("condition not reached")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// proxy forwards a loopback port to the server; tests cut it to simulate network failures.
type proxy struct {
	t      *testing.T
	target string
	addr   string
	mu     sync.Mutex
	ln     net.Listener
	conns  map[net.Conn]struct{}
}

func startProxy(t *testing.T, target string) *proxy {
	p := &proxy{t: t, target: target, addr: "127.0.0.1:0", conns: map[net.Conn]struct{}{}}
	p.listen()
	t.Cleanup(p.stopListening)
	return p
}

func (p *proxy) listen() {
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Error(err)
		return
	}
	p.mu.Lock()
	p.ln, p.addr = ln, ln.Addr().String()
	p.mu.Unlock()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", p.target)
			if err != nil {
				conn.Close()
				continue
			}
			p.mu.Lock()
			p.conns[conn], p.conns[up] = struct{}{}, struct{}{}
			p.mu.Unlock()
			go func() { _, _ = io.Copy(up, conn); up.Close(); conn.Close() }()
			go func() { _, _ = io.Copy(conn, up); up.Close(); conn.Close() }()
		}
	}()
}

func (p *proxy) drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	p.conns = map[net.Conn]struct{}{}
}

func (p *proxy) stopListening() {
	p.mu.Lock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	p.mu.Unlock()
	p.drop()
}
