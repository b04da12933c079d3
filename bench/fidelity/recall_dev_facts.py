"""The development facts of the fact-recall bench: search and recall were tuned on these only.

``recall.py --set dev`` runs them (another filler seed); the recorded figures come from the score
set in ``recall.py`` (``FACTS``), which no setting was chosen on. Same mix as the score set: 14
said by the user or assistant, 6 inside long tool outputs, of the kinds the issue lists (a
preference, hosts, a file and line, ids, names, a date, a region, a secret path, non-English text).
"""

from __future__ import annotations

# (where, statement, needle, question)
DEV_FACTS: list[tuple[str, str, str, str]] = [
    (
        "user",
        "I like short commit messages, never more than one line.",
        "one line",
        "How long should commit messages be?",
    ),
    (
        "user",
        "The metrics backend lives at prometheus-7.monitoring.example.net today.",
        "prometheus-7.monitoring.example.net",
        "Where does the metrics backend live?",
    ),
    (
        "assistant",
        "The leak is in lib/pool/conn_reaper.go:88 where the timer is never stopped.",
        "lib/pool/conn_reaper.go:88",
        "Where is the leak in the code?",
    ),
    ("user", "Our change request is CHG-20931, approved yesterday.", "CHG-20931", "What is the change request number?"),
    (
        "user",
        "Ask Ingrid Østergaard about the firewall rules.",
        "Ingrid Østergaard",
        "Who knows about the firewall rules?",
    ),
    ("user", "The audit happens on 2026-09-02 in the morning.", "2026-09-02", "What day is the audit?"),
    ("user", "Deploy the workers to us-east-2 only.", "us-east-2", "Which region are the workers deployed to?"),
    (
        "tool",
        "kv store path kv/teams/search/api-keys rotated successfully",
        "kv/teams/search/api-keys",
        "Which kv path holds the search api keys?",
    ),
    ("user", "Договор подписывает Мария Петрова.", "Мария Петрова", "Кто подписывает договор?"),
    (
        "tool",
        "dashboard https://grafana.example.io/d/latency-42 shows the spike",
        "https://grafana.example.io/d/latency-42",
        "Which dashboard shows the latency spike?",
    ),
    ("user", "Keep the batch size at 256 items per request.", "256 items", "What batch size should we use?"),
    (
        "tool",
        "queue broker mq-3.internal.example.com dropped 17 messages",
        "mq-3.internal.example.com",
        "Which broker dropped messages?",
    ),
    (
        "assistant",
        "The customer's tenant id is tnt_77ab31 in staging.",
        "tnt_77ab31",
        "What is the customer's tenant id?",
    ),
    ("user", "Tag the release as v4.12.0 when done.", "v4.12.0", "What version tag should the release get?"),
    (
        "user",
        "Send the report to finance-team@example.org on Fridays.",
        "finance-team@example.org",
        "Where do we send the report?",
    ),
    (
        "tool",
        "standby node answered from 192.168.40.12 after failover",
        "192.168.40.12",
        "What address did the standby node answer from?",
    ),
    ("user", "Never push directly to the main branch.", "main branch", "Where must we never push directly?"),
    ("assistant", "We chose Redis 7 for the session cache.", "Redis 7", "What did we choose for the session cache?"),
    (
        "tool",
        "artifact digest sha256:4be1c09f77 signed and uploaded",
        "4be1c09f77",
        "Which artifact digest was uploaded?",
    ),
    ("tool", "token for ci-runner expires 2027-01-15", "2027-01-15", "When does the ci-runner token expire?"),
]
