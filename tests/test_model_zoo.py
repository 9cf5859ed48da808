"""Models as users write them (issue 15): Hugging Face transformers text, vision and audio models, torchvision and
timm models at small random-init configs, and plain torch modules, traced into jobs and run by the worker's
interpreter, equal to eager. The coverage table: ``python scripts/model_coverage.py``."""

import pytest
import torch

from gpunet.testing.zoo import import_torchvision, models, try_model

ZOO = models()
#: Known not to convert, and why; a model that starts converting fails its test until it is taken off this list.
#: (GPT-2 was here: torch's decompositions could not replay its Conv1D's view of the merged heads; gpunet.job.trace
#: now retries them with views as reshapes.)
KNOWN_FAILING: dict[str, str] = {}


@pytest.mark.filterwarnings("ignore:The tensor attributes .* were assigned during export")  # timm's LeViT caches
@pytest.mark.parametrize("model", ZOO, ids=[m.name for m in ZOO])
def test_model_converts_and_matches_eager(model):
    trial = try_model(model)
    if model.name in KNOWN_FAILING:
        assert not trial.ok and trial.stage == KNOWN_FAILING[model.name], (
            f"{model.name} now gives {trial.stage}: take it off KNOWN_FAILING")
        assert "three steps" in trial.detail or "second of three" in trial.detail  # the error names its step
        return
    assert trial.ok, f"{model.name}: {trial.stage}: {trial.detail}"


def test_the_zoo_spans_text_vision_audio_and_plain_torch():
    pytest.importorskip("transformers", reason="the zoo's Hugging Face models need `pip install transformers` "
                                               "(the project's set-up installs it)")
    kinds = {m.kind for m in ZOO}
    assert len(ZOO) >= 30 and kinds == {"text", "vision", "audio", "torch"}


def test_the_zoo_has_torchvision_and_timm_models_beside_a_cpu_torch():
    try:
        import_torchvision()
        import timm  # noqa: F401
    except ImportError:
        pytest.skip("the zoo's torchvision and timm models live in .venv-zoo (bash scripts/zoo_venv.sh, which says "
                    "why apart; .ci/run runs this file there too)")
    assert sum(m.source == "torchvision" for m in ZOO) >= 10 and sum(m.source == "timm" for m in ZOO) >= 10


def test_torchvision_imports_beside_a_cpu_torch_and_its_missing_ops_refuse():
    try:
        tv = import_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed here (it lives in .venv-zoo: bash scripts/zoo_venv.sh)")
    assert import_torchvision() is tv  # a second call finds it imported
    boxes, scores = torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0])
    if tv.extension._has_ops():  # a build whose C++ ops load here: nms really runs
        assert tv.ops.nms(boxes, scores, 0.5).tolist() == [0]
    else:  # only the schema is declared: the op refuses rather than answer
        with pytest.raises(RuntimeError, match="custom C\\+\\+ ops"):
            tv.ops.nms(boxes, scores, 0.5)
