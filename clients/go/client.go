// Package contextsvc is a thin Go client of contextsvc: the generated gRPC client
// (gen/contextsvc/v1) behind one connection that adds default deadlines, bearer tokens, TLS,
// typed errors decoded from google.rpc status details, retries of UNAVAILABLE calls honouring
// RetryInfo, generated request ids for appends, and an events iterator that resumes after a
// dropped stream.
package contextsvc

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"iter"
	"math"
	mrand "math/rand/v2"
	"strings"
	"time"

	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// RetryPolicy paces retries of UNAVAILABLE calls (and only those: a call that is not idempotent only
// when the server says it never started it) and the reconnects of Events.
type RetryPolicy struct {
	MaxAttempts    int           // attempts per call, the first included (1 = no retry); default 4
	InitialBackoff time.Duration // first wait when the server sent no RetryInfo; default 100ms
	MaxBackoff     time.Duration // longest wait (caps a RetryInfo delay too); default 5s
	Multiplier     float64       // growth per attempt; default 2
	MaxReconnects  int           // consecutive failed reconnects before Events gives up; default 10
}

func (p RetryPolicy) withDefaults() RetryPolicy {
	if p.MaxAttempts <= 0 {
		p.MaxAttempts = 4
	}
	if p.InitialBackoff <= 0 {
		p.InitialBackoff = 100 * time.Millisecond
	}
	if p.MaxBackoff <= 0 {
		p.MaxBackoff = 5 * time.Second
	}
	if p.Multiplier < 1 {
		p.Multiplier = 2
	}
	if p.MaxReconnects <= 0 {
		p.MaxReconnects = 10
	}
	return p
}

func (p RetryPolicy) backoff(attempt int, hint time.Duration) time.Duration {
	if hint > 0 {
		return min(hint, p.MaxBackoff)
	}
	ceiling := time.Duration(math.Min(float64(p.MaxBackoff), float64(p.InitialBackoff)*math.Pow(p.Multiplier, float64(attempt))))
	return ceiling/2 + time.Duration(mrand.Int64N(int64(ceiling/2)+1))
}

// MaxReceiveBytes is the largest response a Client reads unless its DialOptions say otherwise
// (grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(n))): the server's own send limit
// (limits.grpc_max_send_bytes, 64 MiB). grpc-go's default of 4 MiB is less than one message at the
// content limit (4 Mi characters) or a view carrying a few screenshots, which the server accepts.
const MaxReceiveBytes = 64 << 20

// Options configure a Client. The zero value is a plaintext connection with defaults.
type Options struct {
	Token       string        // sent as "authorization: Bearer <token>"
	TLS         *tls.Config   // nil = plaintext
	Timeout     time.Duration // default deadline of a call without one (retries included); 0 = 30s, <0 = none
	Retry       RetryPolicy
	DialOptions []grpc.DialOption
}

// Client is one connection to a contextsvc server. Every RPC of the generated
// ContextServiceClient is available on it, with the behaviour described in the package doc.
type Client struct {
	pb.ContextServiceClient
	conn  *grpc.ClientConn
	opts  Options
	retry RetryPolicy
}

// New connects to target ("host:port"); the connection is made lazily on the first call.
func New(target string, opts Options) (*Client, error) {
	c := &Client{opts: opts, retry: opts.Retry.withDefaults()}
	// A token read from a file (a mounted secret) ends with a newline, which grpc-go refuses in a
	// header (INTERNAL); Node's headers (the TypeScript client) drop it, and a token holds no
	// whitespace of its own.
	c.opts.Token = strings.TrimSpace(opts.Token)
	if c.opts.Timeout == 0 {
		c.opts.Timeout = 30 * time.Second
	}
	creds := insecure.NewCredentials()
	if opts.TLS != nil {
		creds = credentials.NewTLS(opts.TLS)
	}
	dial := append([]grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxReceiveBytes)),
		grpc.WithChainUnaryInterceptor(c.unary),
		grpc.WithChainStreamInterceptor(c.stream),
	}, opts.DialOptions...)
	conn, err := grpc.NewClient(target, dial...)
	if err != nil {
		return nil, err
	}
	c.conn = conn
	c.ContextServiceClient = pb.NewContextServiceClient(conn)
	return c, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// withToken adds the client's token unless the call's context carries an authorization of its
// own (one client, a token per call): the service refuses a call with two authorization values.
func (c *Client) withToken(ctx context.Context) context.Context {
	if c.opts.Token == "" {
		return ctx
	}
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get("authorization")) > 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.opts.Token)
}

// tokenError refuses a token no header can carry (anything but visible ASCII and spaces): it is a
// wrong token, UNAUTHENTICATED with reason TOKEN_INVALID as the service and the gateway answer for
// one, not grpc-go's INTERNAL "non-printable ASCII characters" refusal of the header.
func (c *Client) tokenError(ctx context.Context) error {
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get("authorization")) > 0 {
		return nil // the call's own token is sent, not the client's
	}
	for _, r := range c.opts.Token {
		if r < 0x20 || r > 0x7e {
			msg := "the API token holds characters no token has"
			return &Error{Code: codes.Unauthenticated, Message: msg, Reason: "TOKEN_INVALID", Metadata: map[string]string{},
				status: status.New(codes.Unauthenticated, msg)}
		}
	}
	return nil
}

func (c *Client) unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if err := c.tokenError(ctx); err != nil {
		return err
	}
	ctx = c.withToken(ctx)
	if _, ok := ctx.Deadline(); !ok && c.opts.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.opts.Timeout)
		defer cancel()
	}
	for attempt := 1; ; attempt++ {
		err := FromError(invoker(ctx, method, req, reply, cc, opts...))
		var typed *Error
		if err == nil || !errors.As(err, &typed) || typed.Code != codes.Unavailable || attempt >= c.retry.MaxAttempts {
			return err
		}
		if !idempotent(method, req) && !notStartedReasons[typed.Reason] {
			// The server may have applied it: running it again could create a second session,
			// fork twice or compress twice.
			return err
		}
		wait := c.retry.backoff(attempt-1, typed.RetryDelay)
		if deadline, ok := ctx.Deadline(); ok && time.Now().Add(wait).After(deadline) {
			return err
		}
		// The retry paces itself: without this, grpc-go's own reconnect backoff (1 s growing to
		// 2 min) keeps failing every attempt for seconds after a restarted server is back.
		cc.ResetConnectBackoff()
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
	}
}

// notIdempotent lists the calls whose second run differs from their first.
var notIdempotent = map[string]bool{
	pb.ContextService_CreateSession_FullMethodName:  true,
	pb.ContextService_ForkSession_FullMethodName:    true,
	pb.ContextService_DeleteSession_FullMethodName:  true,
	pb.ContextService_RecordBaseline_FullMethodName: true,
}

// notStartedReasons are ErrorInfo reasons of an UNAVAILABLE the server sends before it starts a
// call: any call may be retried after them.
var notStartedReasons = map[string]bool{"SHUTTING_DOWN": true, "STORE_NOT_READY": true}

// idempotent tells whether running req twice has the effect of running it once.
func idempotent(method string, req any) bool {
	if notIdempotent[method] {
		return false
	}
	switch r := req.(type) {
	case *pb.AppendMessagesRequest:
		return r.GetRequestId() != "" // the server applies a request id once
	case *pb.CompressRequest:
		return r.GetDryRun()
	}
	return true
}

func (c *Client) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if err := c.tokenError(ctx); err != nil {
		return nil, err
	}
	s, err := streamer(c.withToken(ctx), desc, cc, method, opts...)
	return s, FromError(err)
}

// AppendMessages appends messages. Without a RequestId the call sends a copy of in with a
// generated one, the same for each of its retries, so they are applied once; in itself is never
// changed, so reusing it for the next turn appends again. Set RequestId to make your own replays
// of a request apply once.
func (c *Client) AppendMessages(ctx context.Context, in *pb.AppendMessagesRequest, opts ...grpc.CallOption) (*pb.AppendMessagesResponse, error) {
	if in != nil && in.GetRequestId() == "" {
		req := proto.Clone(in).(*pb.AppendMessagesRequest)
		req.RequestId = newRequestID()
		in = req
	}
	return c.ContextServiceClient.AppendMessages(ctx, in, opts...)
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = (b[6] & 0x0f) | 0x40
	b[8] = (b[8] & 0x3f) | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// Events yields the events of one session ("" = every session the caller may read) after
// afterEventID (0 = live only). A dropped stream (UNAVAILABLE, or closed by the server) is reopened
// after the last event id seen, so within the server's retention window no event is lost or
// repeated; waits between reconnects back off up to Retry.MaxBackoff, and after
// Retry.MaxReconnects consecutive failures the iterator yields an ErrUnavailable error and stops.
// Other errors are yielded once and end the iteration, as do a session_deleted event of the
// watched session and the end of ctx. However the iteration ends (the loop body breaks or returns
// too), the open stream is closed.
func (c *Client) Events(ctx context.Context, sessionID string, afterEventID int64) iter.Seq2[*pb.Event, error] {
	return func(yield func(*pb.Event, error) bool) {
		// The stream lives as long as ctx: cancel it when the caller stops, or a broken-off loop
		// under a long-lived ctx keeps the stream (and a slot of the server's per-user quota) open.
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		last, failures := afterEventID, 0
		for {
			var hint time.Duration
			var lastErr error
			stream, err := c.StreamEvents(ctx, &pb.StreamEventsRequest{SessionId: sessionID, AfterEventId: last})
			if err == nil {
				for {
					ev, rerr := stream.Recv()
					if rerr != nil {
						err = rerr
						break
					}
					failures, last = 0, ev.GetEventId()
					if !yield(ev, nil) {
						return
					}
					if sessionID != "" && ev.GetSessionDeleted() != nil {
						return
					}
				}
			}
			if ctx.Err() != nil {
				return
			}
			if err != nil && !errors.Is(err, io.EOF) {
				err = FromError(err)
				var typed *Error
				if !errors.As(err, &typed) || typed.Code != codes.Unavailable {
					yield(nil, err)
					return
				}
				hint, lastErr = typed.RetryDelay, err
			}
			if failures >= c.retry.MaxReconnects {
				if lastErr == nil {
					lastErr = fmt.Errorf("%w: event stream closed %d times in a row", ErrUnavailable, failures)
				}
				yield(nil, lastErr)
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(c.retry.backoff(failures, hint)):
			}
			c.conn.ResetConnectBackoff() // reconnect at our pace, not at grpc-go's (see unary)
			failures++
		}
	}
}
