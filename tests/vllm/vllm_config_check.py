"""Run as a script (in vLLM's environment, from a neutral working directory): read a JSON list of
vLLM server argv tails from stdin, and for each one run vLLM's own checks that come before loading
weights -- the server's argument parser, ``validate_parsed_serve_args`` and
``AsyncEngineArgs.create_engine_config`` (what ``vllm.entrypoints.openai.api_server`` runs, in that
order, before it starts the engine core) -- and print one line per argv: ``RESULT_PREFIX`` then
``{"ok": bool, "error": str}`` (vLLM logs to stdout too). All argvs share one interpreter: vLLM's
import alone costs tens of seconds."""

from __future__ import annotations

import contextlib
import io
import json
import sys

RESULT_PREFIX = "kvfleet-vllm-config-check "


def check(argv: list[str]) -> dict[str, object]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        propagate_flash_late_interaction,
        validate_parsed_serve_args,
    )
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        propagate_flash_late_interaction(args, engine_args)
        engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except SystemExit:  # the parser refused an argument; its message went to stderr
        lines = stderr.getvalue().strip().splitlines()
        return {"ok": False, "error": lines[-1] if lines else "the argument parser exited"}
    except Exception as e:  # any refusal is a result to report, whatever its type
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "error": ""}


def main() -> None:
    for argv in json.load(sys.stdin):
        print(RESULT_PREFIX + json.dumps(check(argv)), flush=True)


if __name__ == "__main__":
    main()
