"""A real `spec-batch` API server for the Files and Batches tests: ServerContext + create_app + the batch runner,
served by uvicorn in this process (the tests start it as a subprocess, with PYTHONPATH passed on).

    python tests/server/batch_server.py --db URL --port PORT [--target default] [--draft ngram] [--runner local]

The environment gives the rest (SPEC_BATCH_API_KEYS, SPEC_BATCH_BROKER_URL, SPEC_BATCH_API_MAX_FILE_*), as for
`spec-batch serve`. In the queue runner no model is loaded here: the workers load it.
"""

from __future__ import annotations

import argparse
import dataclasses

import uvicorn

from spec_batch.server.app import create_app
from spec_batch.server.batch_runner import make_batch_runner
from spec_batch.server.batch_validation import make_batch_validator
from spec_batch.server.context import ServerContext
from spec_batch.server.housekeeping import Housekeeping
from spec_batch.server.served import ServedModel
from spec_batch.settings import get_settings
from spec_batch.store import open_store


def build(args: argparse.Namespace) -> ServerContext:
    settings = dataclasses.replace(get_settings(), database_url=args.db, api_runner=args.runner)
    served = ServedModel(args.target, args.target, args.draft)
    decoder = None
    if args.runner == "local":
        from spec_batch import load_decoder

        decoder = load_decoder(args.target, args.draft)
    ctx = ServerContext(settings, open_store(args.db, migrate=True), served, decoder=decoder)
    ctx.services.append(make_batch_runner(ctx))
    ctx.services.append(make_batch_validator(ctx))
    ctx.services.append(Housekeeping(ctx))
    return ctx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--runner", default="local", choices=("local", "queue"))
    args = parser.parse_args()
    uvicorn.run(create_app(build(args)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
