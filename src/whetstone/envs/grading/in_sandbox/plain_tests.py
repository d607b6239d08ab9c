"""Runs plain pytest test modules without pytest: the same tests, the same outcome for each.

Starting pytest costs ~0.35 s of CPU per run, ~9x the whole run of a few plain test functions
(measured in a sandbox: 402 ms against 45 ms), and every rollout runs its tests at least twice
(`run_tests`, then grading). This runner takes only command lines it can run exactly as pytest
would; for anything else `plan` answers None and the caller runs pytest.

A run is plain when the arguments are test files at the repository root plus flags that change
only pytest's report (`-q`, `-rA`, `--tb=...`, `-p no:cacheprovider`, `--rootdir=...`), nothing
configures pytest (no `conftest.py`, ini/`setup.cfg`/`pyproject.toml`, root `__init__.py`), and
each file, read before any code runs, is top-level `def test*():` functions without parameters
or decorators plus code that does not name pytest, unittest, xunit set-up functions, classes, or
the module's own namespace (`globals`, `exec`, `global`, ...). It then does what pytest does with
them: imports every file first (any import error: no test runs, exit 2, like pytest's
"errors during collection"), collects the module's `test*` functions in definition order
(imported ones too), calls each, and counts `Exception` and `SystemExit` as failures,
`KeyboardInterrupt` as the end of the run. Output of the code under test is captured (shown
under a failure) or discarded.

Known difference: its call stack under a test is ~40 frames shallower than pytest's, so code
recursing within ~40 frames of the recursion limit can pass here and fail under pytest.

This file imports nothing from whetstone: `grade_runner.py` imports it from the directory both are
mounted in, and `run_tests` runs it as a script (`python plain_tests.py ARGS...`): pytest's
exit code and a report in the shape of pytest's `-rA --tb=short` (failures with their
repository frames and the compared values, then the summary lines), or exit 3 (NOT_PLAIN) with
nothing on stdout, meaning "run pytest".
"""

from __future__ import annotations

import _ast  # the node classes and the parser flag without `ast`'s imports (~7 ms of CPU per sandbox)
import os
import sys
import types  # not inspect: its import is ~15 ms of CPU in every grading sandbox

TYPE_CHECKING = False
if TYPE_CHECKING:  # `collections.abc` pulls in `collections`: ~2 ms of CPU per sandbox, for annotations only
    from collections.abc import Callable

REPORT_FLAGS = {"-q", "-rA", "-p no:cacheprovider"}
REPORT_PREFIXES = ("--tb=", "--rootdir=")
CONFIG_FILES = ("conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "__init__.py")
FORBIDDEN_NAMES = {
    "pytest",
    "_pytest",
    "unittest",
    "pytestmark",
    "__test__",
    "globals",
    "locals",
    "vars",
    "exec",
    "eval",
    "setattr",
    "delattr",
    "__dict__",
    "modules",
    "setup",
    "teardown",
    "setup_module",
    "teardown_module",
    "setup_function",
    "teardown_function",
    "setUpModule",
    "tearDownModule",
    "pytest_plugins",
}
"""Names whose mention means pytest, or code that could change what a module holds at run time."""

MAX_SOURCE_BYTES = 1 << 20
"""Test files larger than this are left to pytest (the plan parses them, also on the host)."""
# pytest's exit codes
OK, TESTS_FAILED, INTERRUPTED, USAGE_ERROR, NO_TESTS_COLLECTED = 0, 1, 2, 4, 5
NOT_PLAIN = 3
"""The script's exit code when it did not take the run (not plain, or it broke): run pytest."""


def plan(args: list[str], root: str = ".") -> list[str] | None:
    """The targets (files or `file::test` ids) of a pytest command line if the run is plain (see
    the module docstring), else None."""
    targets: list[str] = []
    flags = iter(args)
    for arg in flags:
        if arg == "-p":
            arg = f"-p {next(flags, '')}"
        if arg in REPORT_FLAGS or arg.startswith(REPORT_PREFIXES):
            continue
        name, _, test = arg.partition("::")
        if arg.startswith("-") or "/" in name or not name.endswith(".py") or "::" in test or arg in targets:
            return None
        targets.append(arg)
    if not targets or any(os.path.lexists(os.path.join(root, name)) for name in CONFIG_FILES):
        return None
    for name in _files(targets):
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > MAX_SOURCE_BYTES:
            return None
        if not _plain_source(path):
            return None
    return targets


def _files(targets: list[str]) -> list[str]:
    """The files of `targets`, each once, in order."""
    return list(dict.fromkeys(target.partition("::")[0] for target in targets))


def _plain_source(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            tree = compile(handle.read(), path, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
    except (OSError, SyntaxError, ValueError):
        return False  # pytest reports these its own way
    for node in _nodes(tree):
        if isinstance(node, (_ast.ClassDef, _ast.Global, _ast.Nonlocal)):
            return False
        if isinstance(node, _ast.Name) and node.id in FORBIDDEN_NAMES:
            return False
        if isinstance(node, _ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            return False
        if isinstance(node, (_ast.Import, _ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            names = [alias.name for alias in node.names] + [alias.asname or "" for alias in node.names]
            if any(n.split(".")[0] in FORBIDDEN_NAMES or n == "*" for n in [module, *names]):
                return False
    for node in _nodes(tree, module_level=True):
        if isinstance(node, _ast.AsyncFunctionDef) and node.name.lower().startswith("test"):
            return False
        if isinstance(node, _ast.FunctionDef) and node.name.startswith("test") and not _plain_test(node):
            return False
        bound = _bound_names(node)
        if any(name in FORBIDDEN_NAMES for name in bound):
            return False  # e.g. `def setup_module():`, which pytest would call
        if any(name.lower().startswith("test") for name in bound) and not (
            isinstance(node, _ast.FunctionDef) and node in tree.body
        ):
            return False  # a test bound any other way than a top-level def
    return True


def _children(node: _ast.AST) -> list[_ast.AST]:
    """The direct child nodes of `node` (`ast.iter_child_nodes`)."""
    children = []
    for field in node._fields:
        value = getattr(node, field, None)
        children += [item for item in (value if isinstance(value, list) else [value]) if isinstance(item, _ast.AST)]
    return children


def _nodes(tree: _ast.AST, module_level: bool = False):
    """Every node of `tree`, itself included, in no particular order (`ast.walk`); with
    `module_level`, only those that run in the module's own namespace (function definitions, but
    not their bodies)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not (module_level and isinstance(node, (_ast.FunctionDef, _ast.AsyncFunctionDef, _ast.Lambda))):
            stack.extend(_children(node))


def _bound_names(node: _ast.AST) -> list[str]:
    if isinstance(node, (_ast.FunctionDef, _ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, _ast.Name) and isinstance(node.ctx, _ast.Store):
        return [node.id]
    if isinstance(node, (_ast.Import, _ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, _ast.MatchAs | _ast.MatchStar) and node.name:
        return [node.name]
    return []


def _plain_test(node: _ast.FunctionDef) -> bool:
    arguments = node.args
    if node.decorator_list or arguments.args or arguments.posonlyargs or arguments.kwonlyargs:
        return False
    if arguments.vararg or arguments.kwarg:
        return False
    yields = [n for n in _nodes(node) if isinstance(n, (_ast.Yield, _ast.YieldFrom, _ast.Await))]
    return not yields  # a generator is not a test function to pytest


def run(
    targets: list[str],
    report: Callable[[str, str], None],
    explain: Callable[[str, str], None] | None = None,
    trusted: "Trusted | None" = None,
) -> int:
    """Import every file (paths relative to the working directory, which must be first on
    `sys.path`), then run the targeted tests; `report(test_id, outcome)` for each. Returns pytest's
    exit code. Call `plan` first: this trusts that the targets are plain.

    With `explain`, each failure and collection error also gets `explain(test_id or file, text)`:
    a `--tb=short`-like traceback (`_explanation`); test modules are then loaded with their plain
    asserts rewritten to name the values compared (`_explained_code`), as pytest does.

    With `trusted` (grading), the test files run as the code compiled before any graded code
    ran, and each test defined in them is called from that code, whatever the module holds by
    then; a test function that was replaced meanwhile is reported to `trusted.replaced`."""
    modules = {}
    with _OutputCapture(explain is not None) as captured:
        files = _files(targets)
        for name in files:
            try:
                code = trusted.code[name] if trusted is not None else None
                modules[name] = _collect(_import(name, explained=explain is not None, code=code))
            except KeyboardInterrupt:
                return INTERRUPTED
            except BaseException as error:
                report(name, "error")
                if explain is not None:
                    explain(name, _explanation(error, captured.take()))
        if len(modules) < len(files):  # pytest runs nothing after a collection error
            return INTERRUPTED
        tests: dict[str, Callable[[], object]] = {}
        for target in targets:
            name, _, selected = target.partition("::")
            found = {f"{name}::{test}": function for test, function in modules[name] if selected in ("", test)}
            if trusted is not None:
                found = {test_id: trusted.callable(test_id, function) for test_id, function in found.items()}
            if not found:
                return USAGE_ERROR if selected else NO_TESTS_COLLECTED  # pytest: "not found", nothing runs
            tests.update(found)
        failed = 0
        for test_id, function in tests.items():
            captured.take()
            try:
                function()
                outcome = "passed"
            except KeyboardInterrupt:
                return INTERRUPTED
            except (Exception, SystemExit) as error:
                outcome = "failed"
                if explain is not None:
                    explain(test_id, _explanation(error, captured.take()))
            failed += outcome != "passed"
            report(test_id, outcome)
    return TESTS_FAILED if failed else OK


def _import(name: str, explained: bool = False, code=None):
    """Import test file `name` as pytest would; with `explained`, its asserts rewritten; with
    `code`, that module code (compiled from the file earlier) instead of the file's text now."""
    import importlib
    import importlib.machinery
    from importlib._bootstrap import module_from_spec  # importlib.util's, without util's ~4 ms of imports

    module_name = name[: -len(".py")]
    sys.modules.pop(module_name, None)
    if not explained and code is None:
        module = importlib.import_module(module_name)
    else:  # what the import system does, with our own code object
        spec = importlib.machinery.PathFinder.find_spec(module_name)  # sys.path, like the import below
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ImportError(f"{module_name} is not {name}")
        module = module_from_spec(spec)
        if code is None:
            with open(spec.origin, "rb") as handle:
                code = _explained_code(handle.read(), spec.origin)
        sys.modules[module_name] = module
        try:
            exec(code, module.__dict__)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
    if os.path.realpath(getattr(module, "__file__", None) or "") != os.path.realpath(name):
        raise ImportError(f"{module_name} is not {name}")  # pytest: import file mismatch
    return module


class Trusted:
    """The test files' code, compiled before any graded code runs (`Trusted.compile(targets)`).

    Graded code shares the process with the tests, so by the time a test is called it may have
    replaced the test function, or its `__code__`, in the module (from a thread, an import hook,
    a callback). The runner therefore calls each test defined in a file as a new function made
    from that file's own code object, in the module's namespace, and reports a module whose
    function no longer runs that code. Tests a file imports from elsewhere run as found."""

    def __init__(self, code: dict, replaced: Callable[[str, str], None]):
        self.code = code
        self.replaced = replaced

    @classmethod
    def compile(cls, targets: list[str], replaced: Callable[[str, str], None]) -> "Trusted":
        code = {}
        for name in _files(targets):
            with open(name, "rb") as handle:
                code[name] = compile(handle.read(), os.path.abspath(name), "exec", dont_inherit=True)
        return cls(code, replaced)

    def callable(self, test_id: str, function: Callable[[], object]) -> Callable[[], object]:
        """What to call for the collected `function`: its file's own code, checked at call time."""
        name, _, test = test_id.partition("::")
        code = defined_code(self.code[name], test)
        if code is None:
            return function  # imported into the file: not its code to vouch for
        module = sys.modules.get(name[: -len(".py")])

        def call() -> object:
            current = module.__dict__.get(test) if module is not None else None
            if current is not function or function.__code__ is not code:
                replaced = current if current is not None else function
                where = getattr(getattr(replaced, "__code__", None), "co_filename", type(replaced).__name__)
                self.replaced(test_id, where)
            return types.FunctionType(code, module.__dict__ if module is not None else function.__globals__, test)()

        return call


def defined_code(module_code, qualname: str):
    """The code object of the function `qualname` (e.g. `test_1`, `TestX.test_1`) that the module
    compiled to `module_code` defines, class bodies included; of several definitions the last, the
    one the module's namespace ends up holding. None if it defines none."""
    found = None
    for const in module_code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_qualname == qualname:
                found = const
            elif qualname.startswith(const.co_qualname + "."):
                found = defined_code(const, qualname) or found
    return found


def _explained_code(source: bytes, path: str):
    """The module compiled with its plain asserts rewritten to name the values they compare, as
    pytest does. `ast` is imported only here: grading never explains, and the import costs ~7 ms."""
    import ast

    class AssertExplainer(ast.NodeTransformer):
        """`assert a == b` becomes: evaluate a, then b (once each, in Python's order), and if the
        comparison fails raise `AssertionError("assert <repr a> == <repr b>")`; `assert x` likewise
        names x's value (a chained comparison: its result). Asserts with a message are left as they are."""

        OPERATORS = {
            ast.Eq: "==",
            ast.NotEq: "!=",
            ast.Lt: "<",
            ast.LtE: "<=",
            ast.Gt: ">",
            ast.GtE: ">=",
            ast.Is: "is",
            ast.IsNot: "is not",
            ast.In: "in",
            ast.NotIn: "not in",
        }

        def __init__(self) -> None:
            self.count = 0

        def _name(self, suffix: str, ctx) -> ast.Name:
            return ast.Name(f"_plain_tests_value_{self.count}{suffix}", ctx)

        def visit_Assert(self, node: ast.Assert):
            if node.msg is not None:
                return node
            test = node.test
            self.count += 1
            if isinstance(test, ast.Compare) and len(test.ops) == 1:
                operands = [test.left, test.comparators[0]]
                assigns = [ast.Assign([self._name(side, ast.Store())], value) for side, value in zip("lr", operands)]
                left, right = self._name("l", ast.Load()), self._name("r", ast.Load())
                condition = ast.Compare(left, test.ops, [right])
                parts = [left, ast.Constant(f" {self.OPERATORS[type(test.ops[0])]} "), right]
            else:
                assigns = [ast.Assign([self._name("", ast.Store())], test)]
                condition = self._name("", ast.Load())
                parts = [condition]
            message = ast.JoinedStr(
                [
                    ast.Constant("assert "),
                    *(
                        ast.FormattedValue(part, ord("r"), None) if isinstance(part, ast.Name) else part
                        for part in parts
                    ),
                ]
            )
            raise_ = ast.Raise(ast.Call(ast.Name("AssertionError", ast.Load()), [message], []), None)
            statements = [*assigns, ast.If(ast.UnaryOp(ast.Not(), condition), [raise_], [])]
            return [ast.copy_location(statement, node) for statement in statements]

    tree = AssertExplainer().visit(ast.parse(source, path))
    return compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True)


def _explanation(error: BaseException, output: str) -> str:
    """pytest's `--tb=short` shape: `file:line: in function` and the source line for each frame
    in the working directory, then `E   ` and the exception; the test's output below."""
    import traceback

    root = os.getcwd().rstrip("/") + "/"
    lines = []
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith(root):
            lines.append(f"{frame.filename[len(root) :]}:{frame.lineno}: in {frame.name}")
            if frame.line:
                lines.append(f"    {frame.line}")
    if isinstance(error, AssertionError) and str(error).startswith("assert "):
        message = [str(error)]  # pytest's way of showing a failed comparison
    else:
        message = traceback.format_exception_only(type(error), error)
    lines += [f"E   {line}" for chunk in message for line in chunk.rstrip("\n").splitlines()]
    if output.strip():
        lines += [
            "----------------------------- Captured output -----------------------------",
            _head(output.rstrip("\n"), 2000),
        ]
    return "\n".join(lines)


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def _collect(module) -> list[tuple[str, Callable[[], object]]]:
    """pytest's collection of a plain module: functions named `test*` in its namespace, in order."""
    collected = []
    for name, value in list(module.__dict__.items()):
        if name.startswith("test") and isinstance(value, types.FunctionType):
            collected.append((name, value))
        elif name.startswith("Test") and isinstance(value, type):
            raise RuntimeError(f"{module.__name__}.{name}: a class appeared at import time")
    return collected


class _OutputCapture:
    """File descriptors 1 and 2 point away from the terminal while tests run (pytest captures them):
    to /dev/null, or, when `keep`, to a temporary file whose text `take()` returns and clears."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    def __enter__(self) -> "_OutputCapture":
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        if self.keep:
            import tempfile

            self.file = tempfile.TemporaryFile()
            target = self.file.fileno()
        else:
            target = os.open(os.devnull, os.O_WRONLY)
        os.dup2(target, 1), os.dup2(target, 2)
        if not self.keep:
            os.close(target)
        return self

    def take(self) -> str:
        """What the tests wrote since the last call (empty when not kept)."""
        if not self.keep:
            return ""
        self._flush()
        self.file.seek(0)
        text = self.file.read(1 << 16).decode(errors="replace")
        self.file.seek(0)
        self.file.truncate()
        return text

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    def __exit__(self, *exc):
        self._flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        if self.keep:
            self.file.close()


def _main() -> int:
    """`run_tests`' fast path: pytest's `-rA --tb=short` report shape (the first failure's
    traceback under a `___ name ___` line, then the summary lines), and pytest's exit code; exit
    NOT_PLAIN, with nothing on stdout, for a run it does not take (then pytest runs)."""
    args = sys.argv[1:]
    sys.path[0] = os.getcwd()  # what `python -m pytest` puts first; this script's directory leaves
    targets = plan(args)
    if targets is None:
        return NOT_PLAIN
    outcomes: dict[str, str] = {}
    details: dict[str, str] = {}
    try:
        code = run(targets, outcomes.__setitem__, explain=details.__setitem__)
    except BaseException:
        return NOT_PLAIN
    if code not in (OK, TESTS_FAILED, INTERRUPTED) or not outcomes:
        return NOT_PLAIN  # nothing ran (a missing test id, no tests): pytest's own words
    report = []
    if details:
        title = "FAILURES" if "failed" in outcomes.values() else "ERRORS"
        report.append(f"=== {title} ===")
        for test_id, text in details.items():
            heading = test_id.partition("::")[2] or f"ERROR collecting {test_id}"
            report += [f"___ {heading} ___", text]
    report.append("=== short test summary info ===")
    order = {"passed": 0, "failed": 1, "error": 2}
    for test_id, outcome in sorted(outcomes.items(), key=lambda item: order[item[1]]):
        last = next(
            (line[4:] for line in reversed(details.get(test_id, "").splitlines()) if line.startswith("E   ")), ""
        )
        report.append(f"{outcome.upper()} {test_id}" + (f" - {last}" if last else ""))
    counts = {outcome: list(outcomes.values()).count(outcome) for outcome in ("failed", "passed", "error")}
    report.append(", ".join(f"{n} {'errors' if o == 'error' and n > 1 else o}" for o, n in counts.items() if n))
    print("\n".join(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(_main())
