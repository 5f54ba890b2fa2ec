"""The ``adjoint-compile`` command line (``adjoint-compile --help``; docs/cli.md).

    adjoint-compile explain path/to/file.py:factory --input "randn(2,1024,64)" [--input ...] [--options JSON] [--json]
    adjoint-compile dump    path/to/file.py:factory --input "randn(2,1024,64)" [--out DIR (default out/dump)]
    adjoint-compile demo    [demo arguments]

``factory`` is a function (or ``nn.Module`` class) in the file, called with no arguments, that returns an
``nn.Module`` or a function; a module-level ``nn.Module`` is used as is. The file is imported as a module, as the
user's own ``import`` would (its loops are then traced as in their script). ``--input`` builds one tensor from a
small, safe expression language: ``randn(2,1024,64)``, ``rand(...)``, ``ones(...)``, ``zeros(...)``,
``randint(low, high, (shape))`` with int arguments and an optional
``dtype=float32|float16|bfloat16|float64|int64|int32|bool``; nothing else is evaluated. ``dump`` writes each captured
FX graph as text and a picture with the recognized regions highlighted (cli_dump.py).

A mistake (a bad argument, or the file, its factory or the model raising on the inputs) prints one ``error:`` line
naming it and exits with status 2, as argparse does; ``--traceback`` shows the whole trace instead.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .cli_dump import dump, short_name
from .errors import OptionsError
from .explain import Report, explain
from .options import SUMMARY, validate

log = logging.getLogger(__name__)

__all__ = ["main", "parse_input", "load_factory", "dump", "short_name", "CliError"]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int64": torch.int64,
           "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool}
DEFAULT_DUMP = os.path.join("out", "dump")
_MAKERS = {"randn": torch.randn, "rand": torch.rand, "ones": torch.ones, "zeros": torch.zeros}


def _int(node: ast.AST, expr: str) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int(node.operand, expr)
    raise ValueError(f"--input {expr!r}: expected an int, got {ast.unparse(node)!r}")


def parse_input(expr: str) -> torch.Tensor:
    """A tensor from ``randn(2,1024,64)``-style text, parsed with :mod:`ast` (no ``eval``).

    Allowed: ``randn|rand|ones|zeros(*sizes, dtype=...)`` and ``randint(low, high, (sizes), dtype=...)`` (also
    ``randint(high, (sizes))``); sizes are int literals (or one tuple/list of them). Raises ValueError naming
    ``--input`` otherwise.
    """
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"--input {expr!r} is not an expression like randn(2,1024,64): {e.msg}") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError(f"--input {expr!r}: expected a call like randn(2,1024,64)")
    name = call.func.id
    if name not in _MAKERS and name != "randint":
        raise ValueError(f"--input {expr!r}: {name!r} is not allowed; use one of randn, rand, ones, zeros, randint")
    kw: dict[str, Any] = {}
    for k in call.keywords:
        if k.arg != "dtype":
            raise ValueError(f"--input {expr!r}: only the dtype= keyword is allowed, got {k.arg}=")
        v = k.value
        dname = v.attr if isinstance(v, ast.Attribute) else (v.id if isinstance(v, ast.Name) else
                                                             (v.value if isinstance(v, ast.Constant) else None))
        if dname not in _DTYPES:
            raise ValueError(f"--input {expr!r}: dtype must be one of {', '.join(_DTYPES)}")
        kw["dtype"] = _DTYPES[dname]

    def sizes(args: list[ast.expr]) -> list[int]:
        if len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List)):
            args = list(args[0].elts)
        out = [_int(a, expr) for a in args]
        if any(s < 0 for s in out):
            raise ValueError(f"--input {expr!r}: sizes must be >= 0")
        return out

    if name == "randint":
        args = list(call.args)
        if len(args) == 2:
            low, high, shape = 0, _int(args[0], expr), sizes([args[1]])
        elif len(args) == 3:
            low, high, shape = _int(args[0], expr), _int(args[1], expr), sizes([args[2]])
        else:
            raise ValueError(f"--input {expr!r}: randint takes (high, (sizes)) or (low, high, (sizes))")
        return torch.randint(low, high, tuple(shape), dtype=kw.get("dtype", torch.int64))
    shape = sizes(list(call.args))
    dtype = kw.get("dtype", torch.float32)
    if name in ("randn", "rand") and not dtype.is_floating_point:
        raise ValueError(f"--input {expr!r}: {name} needs a floating dtype")
    return _MAKERS[name](*shape, dtype=dtype)


class CliError(ValueError):
    """A mistake main() prints as one ``error:`` line with exit status 2 (``--traceback``: the whole trace)."""


#: where a traceback's frame is not the user's: torch, this package and Python's own library
_NOT_USER = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, argparse)) + (str(Path(__file__).parent),)


def _raised(what: str, e: BaseException, hint: str = "") -> CliError:
    """``what raised TypeError: its message (at file.py:12 in forward)``: the exception's first line and the deepest
    frame in the user's code, for an error that the user's file, factory or model raised."""
    where = [f for f in traceback.extract_tb(e.__traceback__)
             if not f.filename.startswith("<") and not str(Path(f.filename).resolve()).startswith(_NOT_USER)]
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    at = f" (at {Path(where[-1].filename).name}:{where[-1].lineno} in {where[-1].name})" if where else ""
    return CliError(f"{what} raised {type(e).__name__}{': ' + first if first else ''}{at}{hint}; --traceback shows "
                    f"the whole trace")


def _required(fn: Any) -> list[str] | None:
    """The parameters a call with no arguments would miss (None when the signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def load_factory(spec: str) -> Any:
    """``path/to/file.py:factory`` -> the model or function the factory returns.

    The file is imported as a module registered in ``sys.modules`` (as ``import`` would, under the name
    ``_adjoint_compile_user_<stem>``), with its folder on ``sys.path``, so the model is traced as in the user's own
    script: dynamo rolls the loops of its functions only when it finds their module there (polyfills/loops.py).
    Raises :class:`CliError` naming the model for a bad spec, and when the file or the factory raises."""
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr:
        raise CliError(f"model {spec!r}: expected path/to/file.py:factory")
    file = Path(path)
    if not file.is_file():
        raise CliError(f"model {spec!r}: no such file {path!r}")
    mod_name = f"_adjoint_compile_user_{file.stem}"
    spec_ = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec_)
    folder = str(file.resolve().parent)
    sys.modules[mod_name] = module  # NB: before it runs, as import does (a dataclass in it looks its module up too)
    sys.path.insert(0, folder)  # NB: let the file import its neighbours, also from its factory
    try:
        try:
            spec_.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - the user's file: any error is theirs, shown as one line
            del sys.modules[mod_name]
            raise _raised(f"model {spec!r}: importing {path}", e) from e
        return _build(getattr(module, attr, None), spec, path, attr)
    finally:
        sys.path.remove(folder)


def _build(obj: Any, spec: str, path: str, attr: str) -> Any:
    """The model: ``obj`` itself if an nn.Module, else what calling it with no arguments returns."""
    if obj is None:
        raise CliError(f"model {spec!r}: {path} has no attribute {attr!r}")
    if isinstance(obj, torch.nn.Module):
        return obj
    if not callable(obj):
        raise CliError(f"model {spec!r}: {attr} must be an nn.Module or a factory returning one (or a function)")
    missing = _required(obj)
    if missing:
        fix = (f"add to {path} a factory that takes none, e.g. def make(): return {attr}("
               f"{', '.join(f'{m}=...' for m in missing)}), and pass {path}:make" if isinstance(obj, type) else
               f"if {attr} is the model itself, add def make(): return {attr} to {path} and pass {path}:make; if it "
               f"is a factory, give its arguments defaults")
        raise CliError(f"model {spec!r}: {attr}() needs argument(s) {', '.join(missing)}, but the CLI calls it with "
                       f"none to build the model: {fix}")
    try:
        made = obj()
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise _raised(f"model {spec!r}: {attr}()", e) from e
    if isinstance(made, torch.nn.Module) or callable(made):
        return made
    raise CliError(f"model {spec!r}: {attr}() returned {type(made).__name__}, not an nn.Module or a function")


def parse_options(text: str | None) -> dict[str, Any] | None:
    """``--options`` text -> the options dict (validated, so a bad key fails before the model is built); a
    ValueError naming ``--options`` otherwise."""
    if not text:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--options {text!r} is not valid JSON ({e.msg} at column {e.colno}): write a JSON object, "
                         f"e.g. --options '{{\"mode\": \"truncated\", \"window\": 256}}' (double quotes, lowercase "
                         f"true/false)") from None
    if not isinstance(options, dict):
        raise ValueError(f"--options {text!r}: expected a JSON object of the backend's options, e.g. "
                         f"'{{\"shard_size\": 256}}', got {type(options).__name__}")
    try:
        validate(options)
    except OptionsError as e:
        raise ValueError(f"--options: {e}") from None
    return options


def _required_inputs(model: Any) -> list[str] | None:
    """The names of the positional arguments the model needs (None when its signature cannot be read)."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _most_inputs(model: Any) -> int | None:
    """How many positional arguments the model takes at most (None: unbounded or unreadable)."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _report(args: argparse.Namespace) -> Report:
    options = parse_options(args.options)
    torch.manual_seed(args.seed)
    model = load_factory(args.model)
    inputs = [parse_input(s) for s in args.input]
    need = _required_inputs(model)
    most = _most_inputs(model)
    if most is not None and len(inputs) > most:
        raise ValueError(f"too many --input: {args.model} takes at most {most} input(s) and got {len(inputs)}; give "
                         f"one --input per argument, in order")
    if need is not None and len(inputs) < len(need):
        given = f"got {len(inputs)} --input" if inputs else "no --input was given"
        raise ValueError(f"missing --input: {args.model} takes {len(need)} input(s) ({', '.join(need)}) and "
                         f"{given}; give one --input per argument, in order, e.g. --input \"randn(2,1024,64)\" "
                         f"(shape [batch, time, features]) or --input \"randint(0, 32, (2, 512))\" (token ids)")
    # NB: run once eagerly first: an input the model cannot take then fails in the model's own code, named in one line,
    # not deep in dynamo's trace (with its logged fake-tensor stack). Not under no_grad: a model may take gradients
    # in its forward, and explain's own run keeps as much.
    try:
        model(*inputs)
    except Exception as e:  # noqa: BLE001 - the user's model
        given = " ".join(f"--input {s!r}" for s in args.input) or "no input"
        ids = " (and token ids below its vocabulary size)" if any(not x.is_floating_point() for x in inputs) else ""
        raise _raised("the model", e, hint=f" on {given}: check that each --input has the shape and dtype the model "
                      f"takes{ids}") from e
    return explain(model, *inputs, options=options)


# ----------------------------------------------------------------------------------------------------------------


DESCRIPTION = """\
adjoint-compile: see what the torch.compile backend "adjoint" does with your model, and run its demo.

  explain  print what the backend recognizes in a model (recurrences, scans, residual chains), how it rewrites each
           one, and why not elsewhere
  dump     the same, plus each captured FX graph as text and a picture with the regions coloured
  demo     train a small selective SSM on a long-context copying task with backend="adjoint", then measure one
           training step four ways (eager, torch.compile, checkpointing, adjoint)

The model is path/to/file.py:factory, where factory is a function (or nn.Module class) in that file returning an
nn.Module or a function, or a module-level nn.Module. --input builds an example input from a small safe expression:
randn(2,1024,64), rand(...), ones(...), zeros(...), randint(low, high, (shape)), with an optional
dtype=float32|float16|bfloat16|float64|int64|int32|bool (repeat --input for several inputs)."""

EPILOG = """\
examples:
  adjoint-compile explain examples/selective_ssm.py:make --input "randn(2,2048,16)"
  adjoint-compile explain examples/gru_scan.py:make --input "randn(2,64,8)" --options '{"mode": "highway", "iterations": 2}'
  adjoint-compile dump examples/mamba_conv.py:make --input "randn(2,512,16)" --out out/dump
  adjoint-compile demo --seq-len 1024 --steps 50

--options takes the backend's options as a JSON object, the dict of torch.compile(..., backend="adjoint",
options={...}) (a bad key or value exits with status 2 and names it):
""" + "\n".join(f"  {k:18s} {v}" for k, v in SUMMARY.items())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adjoint-compile", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{explain,dump,demo}")
    for name, help_ in (("explain", "print what the backend recognizes and how it would rewrite it"),
                        ("dump", "write the report and each FX graph as text and a picture (SVG with graphviz, "
                                 "else DOT text) with the regions coloured")):
        s = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".")
        s.add_argument("model", help="path/to/file.py:factory (a function or nn.Module class returning the model, "
                                     "or a module-level nn.Module)")
        s.add_argument("--input", action="append", default=[], metavar="EXPR",
                       help='an example input, e.g. "randn(2,1024,64)" or "randint(0, 32, (2, 512))" (repeat for '
                            'several, in the order the model takes them)')
        s.add_argument("--options", default=None, metavar="JSON",
                       help='backend options as JSON, e.g. \'{"mode": "truncated", "window": 256}\' (default: exact '
                            'mode, shard size chosen automatically; every key: adjoint-compile --help)')
        s.add_argument("--seed", type=int, default=0,
                       help="torch.manual_seed before building the model (default %(default)s)")
        s.add_argument("--traceback", action="store_true",
                       help="on an error, show the whole Python traceback instead of one line")
        if name == "explain":
            s.add_argument("--json", action="store_true", help="print report.to_dict() as JSON instead of the table")
        else:
            s.add_argument("--out", default=DEFAULT_DUMP, metavar="DIR",
                           help="output directory (default %(default)s; out/ is ignored by git in a checkout)")
    # NB: its arguments are the demo's own parser's (adjoint_compile/demo.py): `adjoint-compile demo --help`
    sub.add_parser("demo", help="train the demo model and compare one step four ways (demo --help for its flags)",
                   add_help=False)
    return p


def _out_dir(out: str) -> None:
    """Make dump's ``--out`` directory, or a :class:`CliError` saying why it cannot be."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        what = "is a file" if Path(out).is_file() else f"cannot be made ({e.strerror or e})"
        raise CliError(f"--out {out}: {what}; name a directory that exists or can be made, e.g. --out "
                       f"{DEFAULT_DUMP}") from e


def _dump(report: Report, out: str) -> list[Path]:
    try:
        return dump(report, out)
    except OSError as e:
        raise CliError(f"--out {out}: cannot write there ({e})") from e


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from . import demo  # NB: on demand: the demo pulls in matplotlib and the benchmark helpers

        return int(demo.main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "dump":  # NB: before the model runs, not after
            _out_dir(args.out)
        report = _report(args)
        files = _dump(report, args.out) if args.cmd == "dump" else []
    except ValueError as e:  # NB: OptionsError, bad --input/--options/--out, the user's code raising: one line
        if args.traceback:
            raise
        print(f"adjoint-compile {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "explain":
        print(report.to_json(indent=1, default=str) if args.json else report)
        return 0
    print(report)
    print(f"wrote {len(files)} file(s) to {args.out}: " + ", ".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
