"""The built-in tool environments (calculator, python_tool), their tool dispatch, and the
environment registry (grpo_mega.envs).

What the model writes must never raise into the run: unknown tools, bad arguments and
failing tools become error tool messages; parallel calls are answered one message each,
in order, with the call's id. Config mistakes do raise, naming the bad name or kwarg.
"""
from __future__ import annotations

import re

import pytest

from grpo_mega.envs import (
    ENV_REGISTRY, CalculatorEnv, CalculatorError, Environment, PythonToolEnv, Tool, check_env_kwargs,
    evaluate, make_env, register_env, resolve_env,
)
from grpo_mega.envs.sandbox import Sandbox, SandboxUnavailable
from tests import REPO

ROW = {"prompt": "What is 123 * 4567?", "answer": "561741"}


def call(name, arguments, id=None):
    c = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return c if id is None else {"id": id, **c}


def assistant(*calls, content=""):
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


@pytest.mark.parametrize("expression, value", [
    ("123 * 4567", 561741), ("(2 + 3) ** 2", 25), ("-7 // 2", -4), ("7 % 3", 1), ("84 / 4", 21),
    ("1 / 4", 0.25), ("2 ** -1", 0.5), ("+5 - -5", 10), ("1.5 * 2", 3.0), ("12 × 3", 36),
])
def test_calculator_tool_evaluates_arithmetic(expression, value):
    """Guards against a calculator that refuses plain arithmetic or gets it wrong (exact
    integer division kept an int: "84 / 4" is 21, not 21.0, as the reference is written)."""
    got = evaluate(expression)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("expression, says", [
    ("__import__('os').getpid()", "not Call"),
    ("().__class__.__bases__", "not Attribute"),
    ("open('/etc/passwd')", "not Call"),
    ("x + 1", "not Name"),
    ("[1] * 10", "not List"),
    ("lambda: 1", "not Lambda"),
    ("'a' * 3", "not Constant"),
    ("True + 1", "not Constant"),
    ("2 ^ 3", "use ** for powers"),
    ("1,234 * 2", "thousands separators"),
    ("1 / 0", "division by zero"),
    ("10 ** 1000", "the result of ** has more than 100 digits"),
    ("9 ** 200", "the result of ** has more than 100 digits"),
    ("(10 ** 60) * (10 ** 60)", "more than 100 digits"),
    ("1e308 * 10", "too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +" * 100 + "1", "longer than 200 characters"),
    ("print(1)", "not Call"),
])
def test_calculator_tool_refuses_code_and_huge_results(expression, says):
    """Guards against a calculator that evaluates code (``eval``: the model gets a shell
    through ``__import__``), and against one that computes a power before bounding it
    (``9 ** 9 ** 9`` would take minutes and gigabytes before a size check after the fact;
    the test uses powers that are fast to compute, and asserts the check that came first)."""
    with pytest.raises(CalculatorError) as e:
        evaluate(expression)
    assert says in str(e.value), str(e.value)
    assert CalculatorEnv().calculate(expression).startswith("error: ")


def test_tool_env_parallel_calls_answered_in_order_with_matching_ids():
    """Guards against parallel tool calls answered out of order, merged into one message,
    or with ids that do not match their calls (the model reads the wrong result)."""
    env = CalculatorEnv()
    env.reset(ROW)
    exprs = ["2 * 3", "100 - 1", "7 ** 2"]
    r = env.step(assistant(*[call("calculator", {"expression": e}, id=f"id{i}") for i, e in enumerate(exprs)]))
    assert not r.done and r.reward == 0.0
    assert [(m["role"], m["tool_call_id"], m["name"], m["content"]) for m in r.messages] == [
        ("tool", "id0", "calculator", "6"), ("tool", "id1", "calculator", "99"), ("tool", "id2", "calculator", "49")]
    assert r.info == {"turn": 1, "tool_calls": 3, "tool_errors": 0}


def test_tool_env_bad_calls_become_error_messages_not_exceptions():
    """Guards against a model's bad tool call raising into the run: an unknown tool,
    arguments that are not JSON, not an object, missing, unknown or of the wrong type,
    and a tool function that raises, each give an ``error:`` tool message, in place."""
    env = CalculatorEnv()

    def boom(expression: str) -> str:
        raise RuntimeError("tool bug")

    env.tools.append(Tool("broken", "raises", {"type": "object", "properties": {"expression": {"type": "string"}}},
                          boom))
    env.reset(ROW)
    calls = [call("search", {"q": "x"}, "a"), call("calculator", "{not json", "b"), call("calculator", "[1]", "c"),
             call("calculator", {}, "d"), call("calculator", {"expression": "1", "x": 2}, "e"),
             call("calculator", {"expression": 12}, "f"), call("broken", {"expression": "1"}, "g"),
             call("calculator", '{"expression": "6*7"}')]
    r = env.step(assistant(*calls))
    contents = [m["content"] for m in r.messages]
    assert [m["tool_call_id"] for m in r.messages] == ["a", "b", "c", "d", "e", "f", "g", "call_1_7"]
    assert contents[0] == "error: unknown tool 'search'; available: ['broken', 'calculator']"
    assert "not valid JSON" in contents[1] and "must be a JSON object" in contents[2]
    assert "missing argument(s) ['expression']" in contents[3] and "unknown argument(s) ['x']" in contents[4]
    assert "'expression' must be string, got int" in contents[5]
    assert contents[6] == "error: broken failed: RuntimeError: tool bug"
    assert contents[7] == "42" and r.info["tool_errors"] == 7


def test_tool_env_episode_ends_on_an_answer_or_the_turn_limit_and_scores_it():
    """Guards against an episode that never ends (a model calling tools forever), against
    answering the calls of the last allowed turn (the model would never read them), and
    against a reward that ignores the reference."""
    env = CalculatorEnv(max_turns=2)
    assert env.reset(ROW) == [{"role": "user", "content": ROW["prompt"]}]
    assert not env.step(assistant(call("calculator", {"expression": "123*4567"}, "a"))).done
    last = env.step(assistant(call("calculator", {"expression": "1+1"}, "b"), content="\\boxed{561741}"))
    assert (last.done, last.messages, last.reward) == (True, [], 1.0)
    assert last.info["stop"] == "max_turns" and last.info["unanswered_tool_calls"] == 1

    for answer, reward in (("It is 561741.", 1.0), ("\\boxed{561742}", 0.0), ("I don't know", 0.0)):
        env.reset(ROW)
        r = env.step({"role": "assistant", "content": answer})
        assert (r.done, r.reward, r.info["stop"]) == (True, reward, "answer"), answer


def test_tool_env_reset_reads_messages_and_adds_the_system_prompt():
    """Guards against a reset that drops a chat row's messages or the system prompt, or
    fails on a row without the prompt without naming the field to set."""
    env = CalculatorEnv(system_prompt="Use the calculator.")
    msgs = env.reset({"messages": [{"role": "user", "content": "2*3?"}], "answer": "6"})
    assert msgs == [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "2*3?"}]
    with pytest.raises(KeyError, match="'question'.*prompt_field"):
        CalculatorEnv(prompt_field="question").reset({"text": "x"})


def test_python_tool_env_runs_code_in_the_sandbox():
    """Guards against a python tool that runs the model's code in the trainer's process
    (``exec``: its crash or its ``os.environ`` are the run's) instead of the sandbox."""
    try:
        Sandbox().check()
    except SandboxUnavailable as e:
        pytest.skip(f"no tool sandbox here: {e}")
    env = make_env("python_tool", {"sandbox": {"cpu_seconds": 1}, "reward": {"name": "math", "kwargs":
                                                                               {"use_math_verify": False}}})
    env.reset({"prompt": "6*7?", "answer": "42"})
    code = "import os, sys\nprint(os.getpid(), 'TRAINER' in os.environ)\n6 * 7"
    r = env.step(assistant(call("python", {"code": code}, "a"), call("python", {"code": "raise SystemExit(3)"}, "b")))
    assert [m["content"] for m in r.messages] == ["1 False\n42", "[exit status 3]"]
    assert env.step({"role": "assistant", "content": "\\boxed{42}"}).reward == 1.0
    env.close()


def test_env_registry_resolves_names_and_module_paths():
    """Guards against built-ins missing from the registry, ``module:Class`` names not
    imported, and instances that do not satisfy the Environment protocol."""
    assert {"calculator", "python_tool"} <= set(ENV_REGISTRY)
    assert resolve_env("calculator") is CalculatorEnv and resolve_env("python_tool") is PythonToolEnv
    assert resolve_env("grpo_mega.envs.calculator:CalculatorEnv") is CalculatorEnv
    env = make_env("grpo_mega.envs.calculator:CalculatorEnv", {"max_turns": 3})
    assert isinstance(env, Environment) and env.max_turns == 3


@pytest.fixture
def scratch_registry():
    """ENV_REGISTRY as it was, whatever a test registers."""
    saved = dict(ENV_REGISTRY)
    yield
    ENV_REGISTRY.clear()
    ENV_REGISTRY.update(saved)


def test_env_registry_errors_name_the_bad_name_or_kwarg(scratch_registry):
    """Guards against config mistakes reported without the name to fix: an unknown
    environment (lists the registered ones), a bad module path, an unknown or missing
    kwarg (named with the environment, checkable before building), a double
    registration, and a factory that returns something else than an environment."""
    with pytest.raises(KeyError, match="unknown environment 'calculater'.*'calculator', 'python_tool'"):
        make_env("calculater")
    with pytest.raises(ImportError, match="no_such_module"):
        resolve_env("no_such_module:Env")
    with pytest.raises(AttributeError, match="no class or callable 'Nope'"):
        resolve_env("grpo_mega.envs.calculator:Nope")
    assert "unknown kwarg(s) ['max_turn']" in check_env_kwargs(CalculatorEnv, {"max_turn": 2})
    assert check_env_kwargs(CalculatorEnv, {"max_turns": 2, "max_digits": 50}) is None
    with pytest.raises(TypeError, match=r"environment 'calculator': unknown kwarg\(s\) \['max_turn'\]"):
        make_env("calculator", {"max_turn": 2})
    with pytest.raises(TypeError, match="environment 'needs_x'.*missing a required argument: 'x'"):
        register_env("needs_x")(lambda x: CalculatorEnv())
        make_env("needs_x")
    with pytest.raises(ValueError, match="'calculator' is already registered"):
        register_env("calculator")(PythonToolEnv)
    with pytest.raises(TypeError, match="'not_an_env'.*lacks the Environment protocol"):
        register_env("not_an_env")(lambda: object())
        make_env("not_an_env")
    with pytest.raises(TypeError, match="environment 'calculator': reward 'math'.*'foo'"):
        make_env("calculator", {"reward": {"name": "math", "kwargs": {"foo": 1}}})
    with pytest.raises(TypeError, match=r"'python_tool': sandbox: unknown key\(s\) \['cpu_second'\]"):
        make_env("python_tool", {"sandbox": {"cpu_second": 1}})
    with pytest.raises(ValueError, match="'python_tool': sandbox.cpu_seconds must be > 0, got 0"):
        make_env("python_tool", {"sandbox": {"cpu_seconds": 0}})
    with pytest.raises(ValueError, match="'calculator': max_turns must be >= 1"):
        make_env("calculator", {"max_turns": 0})


def test_env_guide_example_runs(scratch_registry):
    """Guards against the guide's complete example drifting from the code (a renamed
    export, a changed protocol): both Python blocks of "Writing your own environment" run,
    with their assertions."""
    text = (REPO / "docs" / "guides" / "environments.md").read_text()
    section = text.split("## Writing your own environment", 1)[1]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)
    assert len(blocks) == 2, len(blocks)
    namespace: dict = {"__name__": "my_envs"}
    for block in blocks:
        exec(compile(block, "docs/guides/environments.md", "exec"), namespace)
    assert namespace["last"].reward == 1.0 and "inventory" in ENV_REGISTRY
