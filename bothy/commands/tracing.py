"""``bothy trace RUN``: the run's story from the register, as a tree, OTLP/JSON, or sent.

Synchronous, with no event loop: the run's records are read through the index by run id
(bothy/engine/auditindex.py), so a run is shown in a cold start whatever the register's size.
"""

from __future__ import annotations

import argparse
import json
import sys

from bothy.errors import UsageError
from bothy.exitcodes import ExitCode

__all__ = ["cmd_trace"]

_TIMEOUT_S = 10.0


def cmd_trace(args: argparse.Namespace) -> int:
    from bothy import __version__
    from bothy.engine.auditindex import RunIndex
    from bothy.home import BothyHome
    from bothy.trace import OtlpRefused, build_spans, otlp_request, render_tree, send_otlp

    path = BothyHome.from_env().audit_path
    if args.otlp is not None and not args.otlp.startswith(("http://", "https://")):
        raise UsageError(f"--otlp {args.otlp!r} is not an http(s) URL; give the full"
                         " address to POST to, e.g. http://collector:4318/v1/traces")
    records = RunIndex(path).records(args.run_id)
    if not records:
        raise UsageError(f"no record of run {args.run_id!r} in the register ({path});"
                         " `bothy audit` lists the runs it holds")
    spans = build_spans(args.run_id, records)
    if args.otlp is None and not args.json:
        print("\n".join(render_tree(spans)))
        return ExitCode.OK
    request = otlp_request(args.run_id, spans, version=__version__)
    if args.json:
        print(json.dumps(request, indent=2))
    if args.otlp is not None:
        try:
            said = send_otlp(args.otlp, request, timeout_s=_TIMEOUT_S)
        except OtlpRefused as exc:
            print(f"bothy: trace of {args.run_id} not exported: {exc}", file=sys.stderr)
            return ExitCode.FAILED
        print(f"bothy: trace of {args.run_id} exported to {args.otlp}: {len(spans)} spans"
              f" {said}", file=sys.stderr)
    return ExitCode.OK
