package contextsvc_test

import (
	"context"
	"errors"
	"testing"
	"time"

	contextsvc "github.com/contextsvc/contextsvc/clients/go"
	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Without an ErrorInfo the reason is the canonical gRPC code name, as in the Python and
// TypeScript clients.
func TestReasonWithoutErrorInfoIsTheCanonicalCodeName(t *testing.T) {
	ctx := context.Background()
	late := newClient(t, serverAddr, contextsvc.Options{Timeout: time.Microsecond})
	_, err := late.ListSessions(ctx, &pb.ListSessionsRequest{})
	var typed *contextsvc.Error
	if !errors.As(err, &typed) || typed.Code != codes.DeadlineExceeded || typed.Reason != "DEADLINE_EXCEEDED" {
		t.Fatalf("want reason DEADLINE_EXCEEDED, got %v", err)
	}
	p := startProxy(t, serverAddr)
	p.stopListening()
	down := newClient(t, p.addr, contextsvc.Options{Retry: contextsvc.RetryPolicy{MaxAttempts: 1}})
	_, err = down.ListSessions(ctx, &pb.ListSessionsRequest{})
	if !errors.As(err, &typed) || typed.Code != codes.Unavailable || typed.Reason != "UNAVAILABLE" {
		t.Fatalf("want reason UNAVAILABLE, got %v", err)
	}
}

// A quota refusal is ErrResourceExhausted, with the server's RetryInfo delay and QuotaFailure.
func TestResourceExhausted(t *testing.T) {
	addr := startQuotaServer(t, "CONTEXTSVC_QUOTAS__STREAMS_PER_USER=1")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := newClient(t, addr, contextsvc.Options{})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	holdCtx, release := context.WithCancel(ctx)
	defer release()
	held := make(chan struct{})
	go func() { // holds the user's one stream, open once it yielded an event
		for _, err := range c.Events(holdCtx, s.Id, 0) {
			if err != nil {
				return
			}
			select {
			case <-held:
			default:
				close(held)
			}
		}
	}()
	appendUntil(t, ctx, c, s.Id, held)
	var refused error
	for _, err := range c.Events(ctx, s.Id, 0) {
		refused = err
		break
	}
	var typed *contextsvc.Error
	if !errors.Is(refused, contextsvc.ErrResourceExhausted) || errors.Is(refused, contextsvc.ErrUnavailable) || !errors.As(refused, &typed) {
		t.Fatalf("want ErrResourceExhausted, got %v", refused)
	}
	if typed.Code != codes.ResourceExhausted || typed.Reason != "QUOTA_EXCEEDED" || typed.Metadata["limit"] != "streams_per_user" {
		t.Fatalf("details: %+v", typed)
	}
	if typed.RetryDelay != time.Second {
		t.Fatalf("want the server's RetryInfo delay of 1s, got %v", typed.RetryDelay)
	}
	if len(typed.QuotaViolations) != 1 || typed.QuotaViolations[0].Subject != "user:anonymous" || typed.QuotaViolations[0].Description == "" {
		t.Fatalf("quota violations: %+v", typed.QuotaViolations)
	}
}

// Every reason with a class of its own in the Python hierarchy has a sentinel, which also matches
// its family's.
func TestReasonsOfThePythonHierarchyHaveSentinels(t *testing.T) {
	for _, tc := range []struct {
		code   codes.Code
		reason string
		want   error
		family error
	}{
		{codes.InvalidArgument, "REQUEST_ID_REUSED", contextsvc.ErrRequestIDReused, contextsvc.ErrInvalidArgument},
		{codes.FailedPrecondition, "SESSION_DAMAGED", contextsvc.ErrSessionDamaged, contextsvc.ErrFailedPrecondition},
		{codes.FailedPrecondition, "EVENTS_EXPIRED", contextsvc.ErrEventsExpired, contextsvc.ErrFailedPrecondition},
	} {
		st, err := status.New(tc.code, "m").WithDetails(&errdetails.ErrorInfo{Reason: tc.reason, Domain: "contextsvc.dev"})
		if err != nil {
			t.Fatal(err)
		}
		got := contextsvc.FromError(st.Err())
		if !errors.Is(got, tc.want) || !errors.Is(got, tc.family) || errors.Is(got, contextsvc.ErrNothingToCompact) {
			t.Fatalf("%s: want %v and %v, got %v", tc.reason, tc.want, tc.family, got)
		}
	}
}

// A string that is not UTF-8 cannot be encoded: grpc-go says INTERNAL, which the client reports as
// the caller's INVALID_ARGUMENT (the service's answer to such bytes), never as the service's fault.
func TestARequestThatCannotBeEncodedIsInvalidArgument(t *testing.T) {
	ctx := context.Background()
	c := newClient(t, serverAddr, contextsvc.Options{})
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{Name: "utf-8"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{{Role: pb.Role_ROLE_USER, Content: "a\xffb"}}})
	var typed *contextsvc.Error
	if !errors.As(err, &typed) || !errors.Is(err, contextsvc.ErrInvalidArgument) || errors.Is(err, contextsvc.ErrInternal) {
		t.Fatalf("want ErrInvalidArgument, got %v", err)
	}
	if typed.Code != codes.InvalidArgument || typed.Reason != "INVALID_ARGUMENT" || status.Code(err) != codes.InvalidArgument {
		t.Fatalf("details: %+v", typed)
	}
	page, err := c.ListMessages(ctx, &pb.ListMessagesRequest{SessionId: s.Id})
	if err != nil || len(page.Messages) != 0 {
		t.Fatalf("nothing is appended: %v %v", page, err)
	}
}
