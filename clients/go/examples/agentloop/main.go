// Command agentloop is a minimal agent loop on contextsvc with a local fake model.
//
//	go run ./examples/agentloop 127.0.0.1:50051
//
// With CONTEXTSVC_TOKEN set it sends that bearer token; with CONTEXTSVC_CA_FILE (a PEM bundle) it
// connects over TLS trusting those roots.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log"
	"os"

	contextsvc "github.com/contextsvc/contextsvc/clients/go"
	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
)

func ptr[T any](v T) *T { return &v }

// fakeModel asks for one tool call, then answers; it reports prompt tokens like a provider would.
func fakeModel(messages []*pb.Message) (*pb.Message, int64) {
	chars := 0
	for _, m := range messages {
		chars += len(m.Content)
	}
	tokens := int64(chars/4 + 3*len(messages))
	last := messages[len(messages)-1]
	if last.Role == pb.Role_ROLE_USER {
		call := &pb.ToolCall{Id: "call-1", Name: "read_file", ArgumentsJson: `{"path": "main.py"}`}
		return &pb.Message{Role: pb.Role_ROLE_ASSISTANT, ToolCalls: []*pb.ToolCall{call}}, tokens
	}
	return &pb.Message{Role: pb.Role_ROLE_ASSISTANT, Content: fmt.Sprintf("main.py has %d characters.", len(last.Content))}, tokens
}

func main() {
	addr := "127.0.0.1:50051"
	if len(os.Args) > 1 {
		addr = os.Args[1]
	}
	ctx := context.Background()
	opts := contextsvc.Options{Token: os.Getenv("CONTEXTSVC_TOKEN")}
	if caFile := os.Getenv("CONTEXTSVC_CA_FILE"); caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			log.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(pem)
		opts.TLS = &tls.Config{RootCAs: pool}
	}
	c, err := contextsvc.New(addr, opts)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	profile := &pb.Profile{Model: ptr("fake-model"), ContextWindow: ptr[int64](8192), SystemPrompt: ptr("You are a coding agent.")}
	s, err := c.CreateSession(ctx, &pb.CreateSessionRequest{Name: "agent-loop"})
	if err != nil {
		log.Fatal(err)
	}
	ask := &pb.Message{Role: pb.Role_ROLE_USER, Content: "How long is main.py?"}
	if _, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: []*pb.Message{ask}}); err != nil {
		log.Fatal(err)
	}
	phase := pb.Phase_PHASE_PRE_TURN
	for i := 0; i < 8; i++ { // bounded: at most 8 model calls in this turn
		view, err := c.BuildContext(ctx, &pb.BuildContextRequest{SessionId: s.Id, Profile: profile, Phase: phase})
		if err != nil {
			log.Fatal(err)
		}
		reply, tokens := fakeModel(view.Messages)
		if _, err := c.RecordBaseline(ctx, &pb.RecordBaselineRequest{SessionId: s.Id, ViewId: view.ViewId, PromptTokens: tokens}); err != nil {
			log.Fatal(err)
		}
		phase = pb.Phase_PHASE_MID_TURN
		batch := []*pb.Message{reply}
		done := len(reply.ToolCalls) == 0
		if !done {
			batch = append(batch, &pb.Message{Role: pb.Role_ROLE_TOOL, ToolCallId: "call-1", Content: "print('hello')\n"})
		}
		if _, err := c.AppendMessages(ctx, &pb.AppendMessagesRequest{SessionId: s.Id, Messages: batch, TurnComplete: done}); err != nil {
			log.Fatal(err)
		}
		if done {
			fmt.Println("answer:", reply.Content)
			break
		}
	}
	list, err := c.ListMessages(ctx, &pb.ListMessagesRequest{SessionId: s.Id})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("done:", len(list.Messages), "messages in the display history")
}
