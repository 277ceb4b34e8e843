"""``compiled_on_gpu``: where the compilation fails, the function runs eagerly, said once on one line."""

import functools
import types

import torch

from pipeline.modules import gpu_compiled


def test_a_function_whose_compilation_fails_runs_eagerly_after_one_warning(monkeypatch, capsys):
    def failing_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    # a GPU as the decorator sees one, and torch.compile with a backend that fails as a missing toolchain does
    monkeypatch.setattr(gpu_compiled, "_triton_usable", lambda: True)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=failing_backend))
    calls = []

    @gpu_compiled.compiled_on_gpu(lambda first: types.SimpleNamespace(is_cuda=True))
    def doubled(values: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return values * 2

    values = torch.arange(4.0)
    assert torch.equal(doubled(values), values * 2) and torch.equal(doubled(values + 1), (values + 1) * 2)
    assert len(calls) == 2  # eager both times: the failed graph never ran, and is not tried again
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "doubled runs eagerly" in err[0]
    assert "no compiler here" in err[0]


def test_the_warning_names_the_error_of_a_message_that_gives_its_place_first():
    triton_like = RuntimeError("at 43:12:\n    tmp31 = 6364136223846793005*x1\n            ^\n"
                               "ValueError('Scalar 6364136223846793005 is out of range for type int32')")
    assert gpu_compiled._reason(triton_like) == "ValueError('Scalar 6364136223846793005 is out of range for type int32')"
    assert gpu_compiled._reason(RuntimeError("no compiler here\nsee the log")) == "no compiler here"
    assert gpu_compiled._reason(RuntimeError()) == "RuntimeError"


def test_on_the_cpu_the_function_runs_as_written(monkeypatch):
    monkeypatch.setattr(torch, "compile", None)  # never reached

    @gpu_compiled.compiled_on_gpu(lambda first: first)
    def summed(values: torch.Tensor, scale: int) -> torch.Tensor:
        return values.sum() * scale

    assert summed(torch.arange(5), 3).item() == 30


def test_where_the_cpp_wrapper_cannot_be_built_the_python_one_compiles_it_without_a_warning(monkeypatch, capsys):
    tried = []

    def backend(graph, example_inputs, options=None):
        tried.append(dict(options or {}))
        if (options or {}).get("cpp_wrapper"):
            raise RuntimeError("no C++ compiler here")
        return graph.forward

    monkeypatch.setattr(gpu_compiled, "_triton_usable", lambda: True)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))

    @gpu_compiled.compiled_on_gpu(lambda first: types.SimpleNamespace(is_cuda=True))
    def doubled(values: torch.Tensor) -> torch.Tensor:
        return values * 2

    values = torch.arange(4.0)
    assert torch.equal(doubled(values), values * 2) and torch.equal(doubled(values), values * 2)
    assert tried == [{"cpp_wrapper": True}, {}]  # each compiled once: the C++ wrapper first, then the Python one
    assert capsys.readouterr().err == ""
