"""The store's SQLite schema. Token arrays are little-endian int32 blobs, logprobs float32 blobs."""

from __future__ import annotations

SCHEMA_VERSION = 6

# Upgrades of an existing store: version -> the statements that bring version - 1 to it.
MIGRATIONS: dict[int, str] = {
    2: "ALTER TABLE calls ADD COLUMN origin TEXT; ALTER TABLE calls ADD COLUMN parent_span_id BLOB;",
    3: "ALTER TABLE calls ADD COLUMN policy_versions BLOB;",
    4: "ALTER TABLE calls ADD COLUMN held_ms REAL; ALTER TABLE calls ADD COLUMN upstream TEXT;"
    " ALTER TABLE calls ADD COLUMN api TEXT;",
    5: "ALTER TABLE calls ADD COLUMN agent_id TEXT; ALTER TABLE calls ADD COLUMN parent_agent_id TEXT;"
    " ALTER TABLE calls ADD COLUMN compaction INTEGER;",
    6: "ALTER TABLE calls ADD COLUMN fields_dropped TEXT; ALTER TABLE calls ADD COLUMN fields_passed TEXT;",
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    trace_id BLOB NOT NULL,
    span_id BLOB NOT NULL,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    call_seq INTEGER NOT NULL,
    name TEXT NOT NULL,
    start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL,
    prompt_ids BLOB,            -- int32 LE; the suffix when the prompt is sent by reference
    completion_ids BLOB,        -- int32 LE, choice 0
    logprobs BLOB,              -- float32 LE, one per completion token
    prompt_ref_seq INTEGER,
    prompt_ref_length INTEGER,
    prompt_length INTEGER,
    policy_version INTEGER,
    finish_reason TEXT,
    end_reason TEXT,
    tokens_source TEXT,
    choices INTEGER NOT NULL DEFAULT 1,
    status_code INTEGER NOT NULL DEFAULT 0,
    received_at REAL NOT NULL,
    origin TEXT,                -- agl.call.origin (schema 2)
    parent_span_id BLOB,        -- the span's W3C parent (schema 2)
    policy_versions BLOB,       -- int64 LE run-length pairs [start, version, ...] (schema 3; NULL: one version)
    held_ms REAL,               -- agl.call.held_ms: held while training paused the sidecar (schema 4)
    upstream TEXT,              -- agl.call.upstream: the replica that served the call (schema 4)
    api TEXT,                   -- agl.call.api: the front protocol the harness spoke (schema 4)
    agent_id TEXT,              -- agl.call.agent_id: the agent the harness declared (schema 5)
    parent_agent_id TEXT,       -- agl.call.parent_agent_id (schema 5)
    compaction INTEGER,         -- 1: agl.call.compaction, a declared compaction (schema 5)
    fields_dropped TEXT,        -- agl.request.fields.dropped as a JSON array of strings (schema 6)
    fields_passed TEXT,         -- agl.request.fields.passed, the same (schema 6)
    UNIQUE (trace_id, span_id)
);  -- a rowid table: its rows hold kilobytes of token blobs
CREATE INDEX IF NOT EXISTS calls_by_rollout ON calls (rollout_id, attempt, call_seq);

CREATE TABLE IF NOT EXISTS rewards (
    trace_id BLOB NOT NULL,
    span_id BLOB NOT NULL,
    rollout_id TEXT NOT NULL,
    attempt INTEGER,            -- NULL: applies to every attempt of the rollout
    name TEXT NOT NULL,
    value REAL NOT NULL,
    call_seq INTEGER,           -- NULL: a reward for the whole rollout
    end_ns INTEGER NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (trace_id, span_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS rewards_by_rollout ON rewards (rollout_id, attempt);

CREATE TABLE IF NOT EXISTS rollout_spans (
    trace_id BLOB NOT NULL,
    span_id BLOB NOT NULL,
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    PRIMARY KEY (trace_id, span_id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    task_id TEXT,
    mode TEXT,
    status TEXT,                -- agl.rollout.status of the rollout span, when one arrived
    error TEXT,
    started_ns INTEGER,
    ended_ns INTEGER,
    first_seen_at REAL NOT NULL,
    last_span_at REAL NOT NULL,
    rollout_span_at REAL,       -- when the agl.rollout span arrived
    harness_exited_at REAL,
    harness_exit_code INTEGER,
    harness_cause TEXT,
    complete INTEGER NOT NULL DEFAULT 0,
    end_cause TEXT,             -- ok | harness_error | infra_error | timeout | cancelled
    completed_at REAL,
    late_spans INTEGER NOT NULL DEFAULT 0,  -- spans that arrived after completion
    trained_step INTEGER,
    dropped_reason TEXT,
    PRIMARY KEY (rollout_id, attempt)
);
CREATE INDEX IF NOT EXISTS rollouts_ready ON rollouts (complete, trained_step, dropped_reason);

CREATE TABLE IF NOT EXISTS violations (
    trace_id BLOB NOT NULL,
    span_id BLOB NOT NULL,
    name TEXT NOT NULL,
    reason TEXT NOT NULL,
    rollout_id TEXT,
    received_at REAL NOT NULL,
    PRIMARY KEY (trace_id, span_id)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS training_steps (
    step INTEGER PRIMARY KEY,
    rollouts INTEGER NOT NULL,
    at REAL NOT NULL
);

CREATE TABLE IF NOT EXISTS checkpoints (
    step INTEGER PRIMARY KEY,
    path TEXT NOT NULL,
    at REAL NOT NULL
);
"""
