"""The compiler's diagnostics kept for the error message and passed on."""

import os

from mmtrace.agent.kernel import compiler_output


def test_error_lines_are_kept_and_everything_is_passed_on(capfd):
    said = (b"/virtual/main.c:12:5: warning: unused variable 'x'\n"
            b"/virtual/main.c:20:1: error: use of undeclared identifier 'y'\n"
            b"    y = 1;\n    ^\n"
            b"fatal error: 'linux/missing.h' file not found\n"
            b"2 errors generated.\n")
    with compiler_output.captured() as diagnostics:
        os.write(2, said)
        assert capfd.readouterr().err == ""          # held while compiling
    assert diagnostics.errors() == ("/virtual/main.c:20:1: error: use of undeclared "
                                    "identifier 'y'; fatal error: 'linux/missing.h' file "
                                    "not found")
    assert capfd.readouterr().err == said.decode()  # then passed on unchanged


def test_at_most_three_errors_and_none_when_quiet():
    with compiler_output.captured() as quiet:
        pass
    assert quiet.errors() == "" and quiet.text == ""
    with compiler_output.captured() as many:
        os.write(2, b"".join(b"a.c:%d:1: error: e%d\n" % (i, i) for i in range(5)))
    assert many.errors().count("error:") == 3
