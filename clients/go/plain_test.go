package contextsvc_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	contextsvc "github.com/contextsvc/contextsvc/clients/go"
	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
)

// Plain turns timestamps into time.Time (UTC), as its doc says; JSON still shows RFC 3339.
func TestPlainTimestampsAreTimeValues(t *testing.T) {
	c := newClient(t, serverAddr, contextsvc.Options{})
	s, err := c.CreateSession(context.Background(), &pb.CreateSessionRequest{Name: "plain"})
	if err != nil {
		t.Fatal(err)
	}
	plain := contextsvc.Plain(s)
	created, ok := plain["create_time"].(time.Time)
	if !ok {
		t.Fatalf("create_time is %T, want time.Time", plain["create_time"])
	}
	if !created.Equal(s.CreateTime.AsTime()) || created.Location() != time.UTC || time.Since(created) > time.Minute {
		t.Fatalf("create_time = %v, want %v in UTC", created, s.CreateTime.AsTime())
	}
	raw, err := json.Marshal(plain["create_time"])
	if err != nil || string(raw) != `"`+created.Format(time.RFC3339Nano)+`"` {
		t.Fatalf("JSON of create_time: %s %v", raw, err)
	}
	if got := contextsvc.Plain(&pb.Session{})["create_time"]; got != nil {
		t.Fatalf("unset timestamp: want nil, got %#v", got)
	}
}
