"""A second, fresh score set of the fact-recall bench, written after the search and recall rules
were final and run once, untouched since (``recall.py --set holdout``).

Why a second one: the first score set (``FACTS`` in ``recall.py``) was published with the previous
round's figures, so its questions were known while building search; one rule (issue-tracker keys
count as a "ticket") was added after seeing its one miss. This set was never looked at before the
recorded run. Same mix: 14 said by the user or assistant, 6 inside long tool outputs.
"""

from __future__ import annotations

# (where, statement, needle, question)
HOLDOUT_FACTS: list[tuple[str, str, str, str]] = [
    (
        "user",
        "Please always answer me in British English spelling.",
        "British English",
        "Which spelling should you use?",
    ),
    (
        "user",
        "Staging traffic goes through edge-lb-4.staging.example.com from now on.",
        "edge-lb-4.staging.example.com",
        "Which load balancer does staging traffic go through?",
    ),
    (
        "assistant",
        "The null dereference happens at pkg/ingest/parser.rs:311 on empty frames.",
        "pkg/ingest/parser.rs:311",
        "Where does the null dereference happen?",
    ),
    (
        "user",
        "The outage postmortem is PM-0815, owned by the platform team.",
        "PM-0815",
        "What is the postmortem's ticket?",
    ),
    (
        "user",
        "Coordinate the migration with Siobhán O'Neill first.",
        "Siobhán O'Neill",
        "Who must we coordinate the migration with?",
    ),
    ("user", "Our contract renews on 2026-11-30 automatically.", "2026-11-30", "When does the contract renew?"),
    (
        "user",
        "Keep all backups in ap-southeast-1 for compliance.",
        "ap-southeast-1",
        "In which region are backups kept?",
    ),
    (
        "tool",
        "secrets engine mount ops/ssh/deploy-keys unsealed by operator",
        "ops/ssh/deploy-keys",
        "Which secrets mount holds the deploy keys?",
    ),
    ("user", "Смету утверждает Ольга Смирнова.", "Ольга Смирнова", "Кто утверждает смету?"),
    (
        "tool",
        "runbook https://wiki.example.com/runbooks/disk-full-7 linked in alert",
        "https://wiki.example.com/runbooks/disk-full-7",
        "Which runbook is linked in the disk alert?",
    ),
    ("user", "Cap the upload size at 25 MB per file.", "25 MB", "What is the upload size limit?"),
    (
        "tool",
        "search shard es-data-09.prod.example.net relocated 3 shards",
        "es-data-09.prod.example.net",
        "Which search shard node relocated shards?",
    ),
    (
        "assistant",
        "The Stripe customer is cus_Q8x2LmN4 for this account.",
        "cus_Q8x2LmN4",
        "What is the Stripe customer id?",
    ),
    ("user", "Build from the tag hotfix/3.8.2 only.", "hotfix/3.8.2", "Which tag should we build from?"),
    (
        "user",
        "Escalations go to duty-manager@example.net after hours.",
        "duty-manager@example.net",
        "Where do escalations go after hours?",
    ),
    (
        "tool",
        "primary elected at 172.16.8.21 after the leader stepped down",
        "172.16.8.21",
        "What is the address of the newly elected primary?",
    ),
    (
        "user",
        "Don't restart the ingest workers during business hours.",
        "business hours",
        "When must the ingest workers not be restarted?",
    ),
    (
        "assistant",
        "We settled on Kafka 3.7 for the event bus.",
        "Kafka 3.7",
        "What did we settle on for the event bus?",
    ),
    (
        "tool",
        "migration checksum 9c1f0ab37e verified on all replicas",
        "9c1f0ab37e",
        "Which migration checksum was verified?",
    ),
    ("tool", "license key for the scanner expires 2027-04-01", "2027-04-01", "When does the scanner license expire?"),
]
