package contextsvc

import (
	"errors"
	"fmt"
	"strings"
	"time"

	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Sentinel errors for errors.Is, mirroring the Python hierarchy (contextsvc/errors.py):
// errors.Is(err, ErrNothingToCompact) and errors.Is(err, ErrFailedPrecondition) both hold for a
// NOTHING_TO_COMPACT failure.
var (
	ErrNotFound           = errors.New("contextsvc: not found")
	ErrInvalidArgument    = errors.New("contextsvc: invalid argument")
	ErrRequestIDReused    = errors.New("contextsvc: request id reused") // also ErrInvalidArgument
	ErrFailedPrecondition = errors.New("contextsvc: failed precondition")
	ErrNothingToCompact   = errors.New("contextsvc: nothing to compact")
	ErrContextTooLarge    = errors.New("contextsvc: context too large")
	ErrSessionDamaged     = errors.New("contextsvc: session damaged") // also ErrFailedPrecondition
	ErrEventsExpired      = errors.New("contextsvc: events expired")  // also ErrFailedPrecondition
	ErrConflict           = errors.New("contextsvc: conflict")
	ErrUnavailable        = errors.New("contextsvc: unavailable")
	ErrUnimplemented      = errors.New("contextsvc: unimplemented")
	ErrUnauthenticated    = errors.New("contextsvc: unauthenticated")
	ErrInternal           = errors.New("contextsvc: internal")
	// ErrResourceExhausted is a per-user quota or rate limit (RESOURCE_EXHAUSTED, reason
	// QUOTA_EXCEEDED); Error.RetryDelay says when the call would pass, Error.Metadata["limit"]
	// names the limit. It is not retried by the client.
	ErrResourceExhausted = errors.New("contextsvc: resource exhausted")
)

var byReason = map[string]error{
	"NOTHING_TO_COMPACT": ErrNothingToCompact,
	"CONTEXT_TOO_LARGE":  ErrContextTooLarge,
	"REQUEST_ID_REUSED":  ErrRequestIDReused,
	"SESSION_DAMAGED":    ErrSessionDamaged,
	"EVENTS_EXPIRED":     ErrEventsExpired,
}

var byCode = map[codes.Code]error{
	codes.NotFound:           ErrNotFound,
	codes.PermissionDenied:   ErrNotFound,
	codes.InvalidArgument:    ErrInvalidArgument,
	codes.OutOfRange:         ErrInvalidArgument,
	codes.FailedPrecondition: ErrFailedPrecondition,
	codes.Aborted:            ErrConflict,
	codes.AlreadyExists:      ErrConflict,
	codes.Unavailable:        ErrUnavailable,
	codes.DeadlineExceeded:   ErrUnavailable,
	codes.Unimplemented:      ErrUnimplemented,
	codes.Unauthenticated:    ErrUnauthenticated,
	codes.Internal:           ErrInternal,
	codes.ResourceExhausted:  ErrResourceExhausted,
}

// FieldViolation names one bad field of a request (from google.rpc.BadRequest).
type FieldViolation struct {
	Field       string
	Description string
}

// QuotaViolation is one limit a call went over (from google.rpc.QuotaFailure).
type QuotaViolation struct {
	Subject     string // who is over the limit, e.g. "user:anonymous"
	Description string
}

// Error is a failed call with the google.rpc details the server sent.
type Error struct {
	Code       codes.Code
	Message    string
	Reason     string // ErrorInfo reason, e.g. CONTEXT_TOO_LARGE; without one the canonical code name, e.g. DEADLINE_EXCEEDED
	Domain     string
	Metadata   map[string]string
	Violations []FieldViolation
	// QuotaViolations are the limits of a RESOURCE_EXHAUSTED (from QuotaFailure).
	QuotaViolations []QuotaViolation
	RetryDelay      time.Duration // from RetryInfo (UNAVAILABLE, RESOURCE_EXHAUSTED); 0 when the server sent none
	status          *status.Status
}

func (e *Error) Error() string { return fmt.Sprintf("%s (%s): %s", e.Code, e.Reason, e.Message) }

// GRPCStatus lets status.FromError and status.Code see through the typed error.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// Is matches the sentinel of the reason and of its family.
func (e *Error) Is(target error) bool {
	if kind, ok := byReason[e.Reason]; ok && kind == target {
		return true
	}
	kind, ok := byCode[e.Code]
	return ok && kind == target
}

// FromError decodes a gRPC error into *Error; other errors (and nil) come back unchanged.
func FromError(err error) error {
	if err == nil {
		return nil
	}
	var typed *Error
	if errors.As(err, &typed) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	if st.Code() == codes.Internal && strings.HasPrefix(st.Message(), marshalFailure) {
		// grpc-go could not encode the request (a string that is not UTF-8): the caller's bad input,
		// never sent, as the Python client's ValueError and the server's INVALID_ARGUMENT for such
		// bytes; not a defect of the service.
		msg := "the request cannot be encoded: " + strings.TrimPrefix(strings.TrimPrefix(st.Message(), marshalFailure), ": ")
		bad := status.New(codes.InvalidArgument, msg)
		return &Error{Code: codes.InvalidArgument, Message: msg, Reason: codeName(codes.InvalidArgument), Metadata: map[string]string{}, status: bad}
	}
	out := &Error{Code: st.Code(), Message: st.Message(), Reason: codeName(st.Code()), Metadata: map[string]string{}, status: st}
	for _, d := range st.Details() {
		switch v := d.(type) {
		case *errdetails.ErrorInfo:
			out.Reason, out.Domain = v.GetReason(), v.GetDomain()
			for k, val := range v.GetMetadata() {
				out.Metadata[k] = val
			}
		case *errdetails.BadRequest:
			for _, f := range v.GetFieldViolations() {
				out.Violations = append(out.Violations, FieldViolation{Field: f.GetField(), Description: f.GetDescription()})
			}
		case *errdetails.QuotaFailure:
			for _, q := range v.GetViolations() {
				out.QuotaViolations = append(out.QuotaViolations, QuotaViolation{Subject: q.GetSubject(), Description: q.GetDescription()})
			}
		case *errdetails.RetryInfo:
			out.RetryDelay = v.GetRetryDelay().AsDuration()
		}
	}
	return out
}

// marshalFailure starts the message of grpc-go's INTERNAL status for a request it could not encode.
const marshalFailure = "grpc: error while marshaling"

// codeName is the canonical name of a gRPC code (google.rpc.Code), e.g. DEADLINE_EXCEEDED, as the
// Python and TypeScript clients name it; grpc-go's Code.String() is the Go name (DeadlineExceeded).
func codeName(c codes.Code) string {
	if name, ok := rpccode.Code_name[int32(c)]; ok {
		return name
	}
	return fmt.Sprintf("CODE(%d)", uint32(c))
}
