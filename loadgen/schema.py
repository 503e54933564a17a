"""The JSON Schema of `tandem bench --json` reports (draft 2020-12), for consumers and tests."""

from __future__ import annotations

from typing import Any

_NUMBER_OR_NULL: dict[str, Any] = {"type": ["number", "null"]}
_INT_OR_NULL: dict[str, Any] = {"type": ["integer", "null"]}

_SUMMARY: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["count", "mean", "p50", "p90", "p95", "p99", "min", "max"],
    "properties": {
        "count": {"type": "integer", "minimum": 1},
        **{k: {"type": "number"} for k in ("mean", "p50", "p90", "p95", "p99", "min", "max")},
    },
    "additionalProperties": False,
}

_RECORD: dict[str, Any] = {
    "type": "object",
    "required": ["index", "start_s", "status", "output_tokens", "ttft_s", "e2e_s", "error_kind"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "scheduled_s": {"type": "number"},
        "start_s": {"type": "number"},
        "input_tokens": {"type": "integer", "minimum": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "status": _INT_OR_NULL,
        "prompt_tokens": _INT_OR_NULL,
        "output_tokens": _INT_OR_NULL,
        "usage_reported": {"type": "boolean"},
        "ttft_s": _NUMBER_OR_NULL,
        "tpot_s": _NUMBER_OR_NULL,
        "e2e_s": _NUMBER_OR_NULL,
        "chunks": {"type": "integer", "minimum": 0},
        "finish_reason": {"type": ["string", "null"]},
        "error_kind": {"type": ["string", "null"]},
        "error_message": {"type": ["string", "null"]},
    },
}

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": [
        "schema",
        "started_at",
        "config",
        "wall_s",
        "requests",
        "throughput",
        "latency_ms",
        "goodput",
        "replicas",
        "replicas_error",
        "records",
    ],
    "properties": {
        "schema": {"const": "tandem.bench.report/v1"},
        "started_at": {"type": "number"},
        "config": {"type": "object"},
        "wall_s": {"type": "number", "minimum": 0},
        "requests": {
            "type": "object",
            "required": ["sent", "ok", "failed", "by_status", "errors"],
            "properties": {
                "sent": {"type": "integer", "minimum": 0},
                "ok": {"type": "integer", "minimum": 0},
                "failed": {"type": "integer", "minimum": 0},
                "by_status": {
                    "type": "object",
                    "propertyNames": {"pattern": "^([1-5][0-9][0-9]|none)$"},
                    "additionalProperties": {"type": "integer", "minimum": 1},
                },
                "errors": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "object",
                        "required": ["count", "example"],
                        "properties": {
                            "count": {"type": "integer", "minimum": 1},
                            "example": {"type": ["string", "null"]},
                        },
                    },
                },
                "usage_missing": {"type": "integer", "minimum": 0},
                "short_outputs": {"type": "integer", "minimum": 0},
                # Requests dropped in flight by a Ctrl-C; null: the run ran to its end.
                "interrupted": {"type": ["integer", "null"], "minimum": 0},
                # Sends that waited for a --concurrency slot, the longest wait, and
                # whether arrivals within --duration were left unsent.
                "late": {"type": "integer", "minimum": 0},
                "slot_wait_max_s": {"type": "number", "minimum": 0},
                "left_unsent": {"type": "boolean"},
            },
        },
        "throughput": {
            "type": "object",
            "required": ["requests_per_s", "output_tokens_per_s", "input_tokens_per_s"],
            "additionalProperties": {"type": "number", "minimum": 0},
        },
        "latency_ms": {
            "type": "object",
            "required": ["ttft", "tpot", "itl", "e2e"],
            "additionalProperties": _SUMMARY,
        },
        "goodput": {
            "type": "object",
            "required": ["slo_ttft_ms", "slo_tpot_ms", "good", "fraction", "requests_per_s"],
            "properties": {
                "slo_ttft_ms": _NUMBER_OR_NULL,
                "slo_tpot_ms": _NUMBER_OR_NULL,
                "good": {"type": "integer", "minimum": 0},
                "fraction": {"type": "number", "minimum": 0, "maximum": 1},
                "requests_per_s": {"type": "number", "minimum": 0},
            },
        },
        "replicas": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["t_s", "roles"],
                "properties": {
                    "t_s": {"type": "number"},
                    "roles": {"type": "object", "additionalProperties": {"type": "integer"}},
                },
            },
        },
        "replicas_error": {"type": ["string", "null"]},
        "records": {"type": "array", "items": _RECORD},
    },
}
