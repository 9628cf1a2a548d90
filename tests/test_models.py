"""models.resolve: a --model value to what from_pretrained takes, through hooks.MODEL_RESOLVERS."""

import pytest

from lightning_lite import hooks
from lightning_lite.models import resolve


def test_resolve_asks_the_resolvers_first_then_takes_a_directory_or_a_hub_name(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(hooks, "MODEL_RESOLVERS", [])
    assert resolve(str(tmp_path)) == str(tmp_path)
    assert resolve("namespace/name") == "namespace/name"
    # Without extras/embedded.py a model name is refused at once, naming the file (no hub retries).
    with pytest.raises(ValueError, match="extras/embedded.py"):
        resolve("smollm2")
    monkeypatch.setattr(hooks, "MODEL_RESOLVERS", [lambda name: "/m" if name == "mine" else None])
    assert resolve("mine") == "/m"
    with pytest.raises(ValueError, match="nor a name that a resolver"):
        resolve("smolm2")


def test_the_embedded_extra_resolves_its_names():
    from lightning_lite.extras import embedded

    assert embedded.resolve in hooks.MODEL_RESOLVERS
    assert embedded.resolve("not-embedded") is None
    assert resolve("smollm2") == embedded.prepare("smollm2")
