// Command scenario runs clients/scenario/scenario.json with the Go client and writes the
// transcript as JSON:  go run ./cmd/scenario 127.0.0.1:50051 transcript.json
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"time"

	contextsvc "github.com/contextsvc/contextsvc/clients/go"
	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

type step struct {
	Op   string         `json:"op"`
	Args map[string]any `json:"args"`
}

// decode fills a request message from the scenario's plain JSON (proto names, short enum names).
func decode(dst proto.Message, v any) {
	raw, err := json.Marshal(normalize(v))
	check(err)
	check(protojson.Unmarshal(raw, dst))
}

// normalize turns short enum names into full ones for protojson ("user" -> "ROLE_USER").
func normalize(v any) any {
	switch t := v.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, x := range t {
			switch k {
			case "role":
				out[k] = "ROLE_" + upper(x)
			default:
				out[k] = normalize(x)
			}
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, x := range t {
			out[i] = normalize(x)
		}
		return out
	}
	return v
}

func upper(v any) string {
	s := fmt.Sprint(v)
	b := []byte(s)
	for i, c := range b {
		if c >= 'a' && c <= 'z' {
			b[i] = c - 32
		}
	}
	return string(b)
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func main() {
	if len(os.Args) != 3 {
		check(fmt.Errorf("usage: scenario ADDRESS OUT"))
	}
	_, here, _, _ := runtime.Caller(0)
	raw, err := os.ReadFile(filepath.Join(filepath.Dir(here), "..", "..", "..", "scenario", "scenario.json"))
	check(err)
	var doc struct {
		Steps []step `json:"steps"`
	}
	check(json.Unmarshal(raw, &doc))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := contextsvc.New(os.Args[1], contextsvc.Options{})
	check(err)
	defer c.Close()

	var transcript []map[string]any
	var sid, viewID string
	var summarySeq int64
	for _, s := range doc.Steps {
		a := s.Args
		var result any
		switch s.Op {
		case "create_session":
			md, err := structpb.NewStruct(a["metadata"].(map[string]any))
			check(err)
			res, err := c.CreateSession(ctx, &pb.CreateSessionRequest{Name: a["name"].(string), Metadata: md})
			check(err)
			sid, result = res.Id, contextsvc.Plain(res)
		case "append_messages":
			req := &pb.AppendMessagesRequest{SessionId: sid, TurnComplete: a["turn_complete"].(bool)}
			for _, m := range a["messages"].([]any) {
				mm := m.(map[string]any)
				images := mm["images"]
				delete(mm, "images")
				msg := &pb.Message{}
				decode(msg, mm)
				if images != nil {
					for _, img := range images.([]any) {
						data, err := base64.StdEncoding.DecodeString(img.(string))
						check(err)
						msg.Images = append(msg.Images, &pb.Image{Data: data})
					}
				}
				req.Messages = append(req.Messages, msg)
			}
			res, err := c.AppendMessages(ctx, req)
			check(err)
			result = contextsvc.Plain(res)
		case "build_context":
			req := &pb.BuildContextRequest{}
			decode(req, map[string]any{"session_id": sid, "profile": a["profile"], "auto_compress": a["auto_compress"]})
			if in, ok := a["incoming"]; ok {
				req.Incoming = &pb.Message{}
				decode(req.Incoming, in)
			}
			res, err := c.BuildContext(ctx, req)
			check(err)
			viewID, result = res.ViewId, contextsvc.Plain(res)
		case "record_baseline":
			res, err := c.RecordBaseline(ctx, &pb.RecordBaselineRequest{SessionId: sid, ViewId: viewID, PromptTokens: int64(a["prompt_tokens"].(float64))})
			check(err)
			result = contextsvc.Plain(res)
		case "compress":
			req := &pb.CompressRequest{}
			decode(req, map[string]any{"session_id": sid, "profile": a["profile"], "reason": a["reason"]})
			res, err := c.Compress(ctx, req)
			check(err)
			result = contextsvc.Plain(res)
		case "events":
			var events []any
			for ev, err := range c.Events(ctx, sid, int64(a["after_event_id"].(float64))) {
				check(err)
				plain := contextsvc.Plain(ev)
				events = append(events, plain)
				if plain["payload"] == a["until"] {
					summarySeq = ev.GetContextCompressed().GetSummarySequence()
					break
				}
			}
			result = events
		case "list_messages":
			req := &pb.ListMessagesRequest{SessionId: sid}
			req.Buffer = pb.Buffer(pb.Buffer_value["BUFFER_"+upper(a["buffer"])])
			res, err := c.ListMessages(ctx, req)
			check(err)
			result = contextsvc.Plain(res)
		case "search_history":
			res, err := c.SearchHistory(ctx, &pb.SearchHistoryRequest{SessionId: sid, Query: a["query"].(string), Limit: int32(a["limit"].(float64))})
			check(err)
			result = contextsvc.Plain(res)
		case "expand_summary":
			res, err := c.ExpandSummary(ctx, &pb.ExpandSummaryRequest{SessionId: sid, SequenceNumber: summarySeq})
			check(err)
			result = contextsvc.Plain(res)
		case "fork_session":
			res, err := c.ForkSession(ctx, &pb.ForkSessionRequest{SessionId: sid, AtSequence: int64(a["at_sequence"].(float64))})
			check(err)
			sid, result = res.Id, contextsvc.Plain(res)
		default:
			check(fmt.Errorf("unknown op %q", s.Op))
		}
		transcript = append(transcript, map[string]any{"op": s.Op, "result": result})
	}
	out, err := json.MarshalIndent(transcript, "", " ")
	check(err)
	check(os.WriteFile(os.Args[2], out, 0o644))
}
