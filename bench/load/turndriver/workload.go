package main

import (
	"strings"

	pb "github.com/contextsvc/contextsvc/clients/go/gen/contextsvc/v1"
)

// The vocabulary of bench/load/workload.py (_SENTENCES split on whitespace, in order).
var words = strings.Fields("the build failed on the parser module because a token was missing after the import list and " +
	"we need to check the fixture paths config values retry budget cache window latency service " +
	"request handler session compaction summary baseline estimate profile calibration store append")

func text(r *pyRandom, n int) string {
	parts := make([]string, n)
	for i := range parts {
		parts[i] = words[r.below(len(words))]
	}
	return strings.Join(parts, " ")
}

// turnMessages is workload.turn_messages(turn): a user ask of 30 words and an answer of 40.
func turnMessages(turn uint64) []*pb.Message {
	const seed = 11
	r := newPyRandom(seed*1_000_003 + turn)
	return []*pb.Message{
		{Role: pb.Role_ROLE_USER, Content: text(r, 30)},
		{Role: pb.Role_ROLE_ASSISTANT, Content: text(r, 40)},
	}
}
