"""A tool call's arguments checked against the tool's input schema, before
anything runs. The message names the argument, what was expected and what
arrived, in one short line: never the value itself when it is long (a
megabyte string must not come back whole)."""

import json
import math

from jsonschema import Draft202012Validator

from mmtrace.agent.errors import MmtraceError

SHOWN_CHARS = 60
_TYPES = {"integer": "an integer", "number": "a number", "string": "a string",
          "object": "an object", "array": "a list", "boolean": "true or false",
          "null": "null"}


class Arguments:
    def __init__(self, tools: dict):
        self.validators = {name: Draft202012Validator(spec["input"])
                           for name, spec in tools.items()}

    def check(self, tool: str, arguments) -> dict:
        """The arguments as given, or MmtraceError naming the first problem."""
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            raise MmtraceError(f"expected the arguments as an object, got {shown(arguments)}")
        for name, value in sorted(arguments.items()):
            # NaN passes minimum and maximum (every comparison is false)
            if isinstance(value, float) and not math.isfinite(value):
                got = "NaN" if math.isnan(value) else repr(value)
                raise MmtraceError(f"{str(name)[:SHOWN_CHARS]}: expected a finite number, "
                                   f"got {got}")
        errors = sorted(self.validators[tool].iter_errors(arguments),
                        key=lambda e: (list(e.path), e.validator))
        if errors:
            raise MmtraceError(_message(errors[0], arguments))
        return arguments


class Answers:
    """Each answer checked against the tool's output schema before it goes
    out: a client that checks it (the SDK's does) would otherwise fail the
    whole call, where a tool error says which field did not fit."""

    def __init__(self, tools: dict):
        self.validators = {name: Draft202012Validator(spec["output"])
                           for name, spec in tools.items()}

    def check(self, tool: str, answer: dict) -> dict:
        errors = sorted(self.validators[tool].iter_errors(answer),
                        key=lambda e: (list(e.path), e.validator))
        if not errors:
            return answer
        error = errors[0]
        if error.validator == "required":
            missing = [k for k in error.validator_value if k not in error.instance]
            where = ".".join(str(p) for p in [*error.path, missing[0]])
            problem = f"{where}: expected a value, got none"
        else:
            problem = _message(error, {})
        raise MmtraceError(f"the answer does not fit the tool's output schema ({problem}); "
                           "a daemon of another mmtrace version answers so")


def _message(error, arguments: dict) -> str:
    where = ".".join(str(p) for p in error.path) or "arguments"
    value, rule = error.instance, error.validator_value
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        extra = sorted(set(arguments) - set(known))
        return (f"unexpected argument {', '.join(repr(e[:SHOWN_CHARS]) for e in extra[:5])}; "
                f"expected only {', '.join(known) or 'none'}")
    if error.validator == "required":
        return f"missing argument; {error.message[:SHOWN_CHARS * 2]}"
    expected = {
        "type": lambda: " or ".join(_TYPES.get(t, t) for t in
                                    (rule if isinstance(rule, list) else [rule])),
        "minimum": lambda: f"at least {rule}",
        "maximum": lambda: f"at most {rule}",
        "minLength": lambda: f"at least {rule} characters",
        "maxLength": lambda: f"at most {rule} characters",
        "pattern": lambda: f"text matching {rule}",
    }.get(error.validator, lambda: f"{error.validator} {rule}")()
    return f"{where}: expected {expected}, got {shown(value)}"


def shown(value) -> str:
    """A value for a message: its type, and its text when short."""
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"a string of {len(value):,} characters"
    if isinstance(value, (dict, list)):
        kind = "an object" if isinstance(value, dict) else "a list"
        return f"{kind} of {len(value):,} items"
    text = json.dumps(value) if value is None or isinstance(value, (int, float, str)) \
        else repr(value)
    return text[:SHOWN_CHARS]
