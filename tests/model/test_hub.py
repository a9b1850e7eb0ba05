"""Hub round trips against a local test server (`tests/hub_server.py`), through the real client code paths.

Nothing here mocks `huggingface_hub` or `transformers`: the `hub` fixture starts the server on 127.0.0.1 and
points the client at it (`HF_ENDPOINT` and the constants huggingface_hub read from it at import), with Xet off
so LFS uploads use the LFS batch API, and a fresh Hugging Face cache per test.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file
from transformers import AutoModel

from dspark_hf import DSparkDraftModel, cli, last_generation_stats
from dspark_hf.model.hub import model_card, pull_draft, push_draft
from hub_server import ALICE, BOB  # the test Hub's two users (the `hub` fixture in conftest.py)

from helpers import make_aligned_draft, make_target

TARGET_ID = "alice/tiny-target"
# What a push leaves in a repo: config, weights and card (plus the Hub's .gitattributes); no SPS profile.
REPO_FILES = [".gitattributes", "README.md", "config.json", "model.safetensors"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def target():
    model = make_target("llama", markov=True)
    model.config._name_or_path = TARGET_ID
    return model


@pytest.fixture
def draft(target):
    d = make_aligned_draft(target, "markov")
    d.config.calibration_temperatures = [1.25, 1.5, 1.75, 2.0, 2.25]
    return d


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


def _generate(target, draft=None):
    ids = torch.tensor([[3, 17, 42, 5, 60, 8, 11]])
    extra = {"assistant_model": draft} if draft is not None else {}
    return target.generate(ids, max_new_tokens=24, do_sample=False, **extra)


def _perturbed(draft, seed):
    """A copy of `draft` with different weights (a "new version" to push)."""
    new = DSparkDraftModel(draft.config).to(draft.dtype)
    new.load_state_dict(draft.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        new.fc.weight.add_(torch.randn(new.fc.weight.shape, generator=gen, dtype=new.dtype))
    return new


# ---------------------------------------------------------------------------------------------- repos, auth
def test_create_repo_whoami_and_bad_token(hub):
    api = HfApi()
    url = api.create_repo("alice/new-draft")
    assert url.repo_id == "alice/new-draft" and url.startswith(hub.url)
    assert api.create_repo("alice/new-draft", exist_ok=True).repo_id == "alice/new-draft"
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("alice/new-draft")
    assert exc.value.response.status_code == 409
    info = api.model_info("alice/new-draft")
    assert [s.rfilename for s in info.siblings] == [".gitattributes"] and len(info.sha) == 40
    assert api.whoami()["name"] == "alice"
    with pytest.raises(HfHubHTTPError) as exc:  # another user's namespace
        api.create_repo("bob/draft")
    assert exc.value.response.status_code == 403

    bad = HfApi(token="hf_not_a_token")
    for call in (bad.whoami, lambda: bad.create_repo("alice/x"), lambda: bad.model_info("alice/new-draft")):
        with pytest.raises(HfHubHTTPError) as exc:
            call()
        assert exc.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exc:
        DSparkDraftModel.from_pretrained("alice/new-draft", token="hf_not_a_token")
    assert exc.value.response.status_code == 401


def test_private_repo_is_invisible_to_other_tokens(hub, target, draft):
    draft.push_to_hub("alice/secret-draft", private=True)
    assert HfApi().model_info("alice/secret-draft").private
    for token in (BOB, False):  # another user, and anonymous
        with pytest.raises(RepositoryNotFoundError):
            HfApi(token=token).model_info("alice/secret-draft")
        with pytest.raises(RepositoryNotFoundError):
            DSparkDraftModel.from_pretrained("alice/secret-draft", token=token)
        with pytest.raises(RepositoryNotFoundError):
            pull_draft("alice/secret-draft", token=token)
    with pytest.raises(HfHubHTTPError) as exc:  # and bob cannot write into it
        push_draft(draft, "alice/secret-draft", token=BOB)
    assert exc.value.response.status_code in (403, 404)
    assert _same_weights(draft, DSparkDraftModel.from_pretrained("alice/secret-draft", token=ALICE))


# ---------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("mode", ["regular", "lfs"])
def test_push_and_load_round_trip(hub, target, draft, mode):
    hub.upload_mode = mode
    info = draft.push_to_hub("alice/draft")
    api = HfApi()
    assert info.oid == api.model_info("alice/draft").sha
    # config, weights and card only: no target weights, no pickles, no device-specific SPS profile
    assert sorted(api.list_repo_files("alice/draft")) == REPO_FILES
    weights = api.get_paths_info("alice/draft", ["model.safetensors"])[0]
    lfs_puts = [r for r in hub.requests if r[0] == "PUT" and r[1].startswith("/lfs-upload/") and r[2] == 200]
    if mode == "lfs":
        assert weights.lfs is not None and weights.lfs.sha256 and len(lfs_puts) >= 1
    else:
        assert weights.lfs is None and not lfs_puts

    loaded = DSparkDraftModel.from_pretrained("alice/draft", target=target)
    assert loaded.dtype == draft.dtype and _same_weights(draft, loaded)
    assert loaded.config.calibration_temperatures == draft.config.calibration_temperatures
    assert loaded.config.target_name_or_path == TARGET_ID
    assert loaded.config.target_num_hidden_layers == 6 and loaded.config.dspark_version
    out = _generate(target, loaded)
    assert torch.equal(out, _generate(target, draft)) and torch.equal(out, _generate(target))
    assert last_generation_stats(loaded).tau > 1.5  # the accept path really ran

    auto = AutoModel.from_pretrained("alice/draft")
    assert isinstance(auto, DSparkDraftModel) and _same_weights(draft, auto)


def test_pull_by_branch_tag_and_commit(hub, target, draft, tmp_path):
    api = HfApi()
    v1 = draft.push_to_hub("alice/versions").oid
    api.create_tag("alice/versions", tag="v1", revision=v1)
    v2_draft, v3_draft = _perturbed(draft, 1), _perturbed(draft, 2)
    v2 = v2_draft.push_to_hub("alice/versions", revision="dev").oid  # creates the branch
    v3 = v3_draft.push_to_hub("alice/versions").oid

    refs = api.list_repo_refs("alice/versions")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": v3, "dev": v2}
    assert {t.name: t.target_commit for t in refs.tags} == {"v1": v1}
    history = [c.commit_id for c in api.list_repo_commits("alice/versions")]
    assert history[:2] == [v3, v1] and len(history) == 3  # initial commit, v1, v3 on main
    assert [c.commit_id for c in api.list_repo_commits("alice/versions", revision="dev")][0] == v2

    for revision, expected in (("v1", draft), (v1, draft), ("dev", v2_draft), (v2, v2_draft), (None, v3_draft)):
        loaded = DSparkDraftModel.from_pretrained("alice/versions", revision=revision)
        assert _same_weights(expected, loaded), revision
    local = pull_draft("alice/versions", revision="v1", local_dir=tmp_path / "v1")
    assert _same_weights(draft, DSparkDraftModel.from_pretrained(local, target=target))
    assert not _same_weights(draft, v2_draft)


def test_missing_repo_or_revision_raises_the_clients_errors(hub, draft):
    draft.push_to_hub("alice/draft")
    with pytest.raises(RevisionNotFoundError, match="not a branch, tag or commit"):
        DSparkDraftModel.from_pretrained("alice/draft", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        DSparkDraftModel.from_pretrained("alice/draft", revision="0" * 40)
    with pytest.raises(RevisionNotFoundError):
        pull_draft("alice/draft", revision="v9")
    with pytest.raises(RepositoryNotFoundError):
        DSparkDraftModel.from_pretrained("alice/no-such-draft")


def test_model_card_round_trip_with_valid_metadata(hub, draft):
    evaluation = {"gsm8k": {"tau": 3.127, "speedup": 2.41}, "mt-bench": {"tau": 2.8, "speedup": 2.05}}
    training = {"learning_rate": 6e-4, "epochs": 6, "block_size": 5, "loss": "tv+bce"}
    draft.push_to_hub("alice/card-draft", evaluation=evaluation, training_config=training, license="mit", tags=["tiny"])
    card = ModelCard.load("alice/card-draft")
    card.validate()  # the server's metadata check (it rejects invalid metadata, see below)
    assert card.data.library_name == "dspark-hf" and card.data.license == "mit"
    assert card.data.base_model == TARGET_ID
    assert {"dspark", "speculative-decoding", "draft-model", "tiny"} <= set(card.data.tags)
    text = card.text
    assert 'DSparkDraftModel.from_pretrained("alice/card-draft", target=target)' in text
    assert "assistant_model=draft" in text
    assert "| benchmark | tau | speedup |" in text and "| gsm8k | 3.127 | 2.41 |" in text
    assert "learning_rate: 0.0006" in text and "loss: tv+bce" in text
    assert "[1.25, 1.5, 1.75, 2.0, 2.25]" in text  # calibration shown
    assert "SPS profile" in text  # and why it is not in the checkpoint
    info = HfApi().model_info("alice/card-draft")
    assert info.card_data.base_model == TARGET_ID and "dspark" in info.tags

    bad = model_card(draft, "alice/card-draft").content.replace(f"base_model: {TARGET_ID}", "base_model: [1, 2]")
    with pytest.raises(ValueError, match="Invalid metadata"):
        push_draft(draft, "alice/card-draft", card=bad)
    with pytest.raises(ValueError, match="not a Hub model id"):
        model_card(draft, base_model="/models/local-target")
    with pytest.raises(TypeError, match="evaluation"):
        model_card(draft, evaluation=3.1)


def test_deepspec_repo_loads_by_id(hub):
    target = make_target("qwen3", markov=True)
    target.config._name_or_path = "alice/tiny-qwen3"
    draft = make_aligned_draft(target, "gated")
    draft.push_to_hub("alice/deepspec-draft", format="deepspec")
    assert sorted(HfApi().list_repo_files("alice/deepspec-draft")) == REPO_FILES
    config = json.loads(open(pull_draft("alice/deepspec-draft") + "/config.json").read())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert "deepspec" in ModelCard.load("alice/deepspec-draft").data.tags

    loaded = DSparkDraftModel.from_pretrained("alice/deepspec-draft", target=target)
    assert _same_weights(draft, loaded)
    assert torch.equal(_generate(target, loaded), _generate(target))
    with pytest.raises(ValueError, match="not bound"):
        push_draft(DSparkDraftModel(draft.config), "alice/x", format="deepspec")


def test_compatibility_is_checked_when_loading_by_id(hub, draft):
    draft.push_to_hub("alice/draft")
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        DSparkDraftModel.from_pretrained("alice/draft", target=make_target("llama", vocab_size=128))
    other = make_target("llama", seed=5)
    other.config._name_or_path = "someone/else"
    with pytest.warns(UserWarning, match="built for target 'alice/tiny-target'"):
        DSparkDraftModel.from_pretrained("alice/draft", target=other)


# ---------------------------------------------------------------------------------------------- fault
@pytest.mark.parametrize("mode", ["regular", "lfs"])
def test_dropped_connection_leaves_repo_unchanged_and_retry_succeeds(hub, target, draft, mode):
    hub.upload_mode = mode
    api = HfApi()
    before = draft.push_to_hub("alice/fragile").oid
    new = _perturbed(draft, 3)
    # regular: the file contents travel inside the commit request, cut half-way.
    # lfs: the weights' PUT is cut once (the client retries it), then the commit request is cut.
    if mode == "lfs":
        hub.drop_connection("PUT", r"^/lfs-upload/")
    hub.drop_connection("POST", r"/commit/")
    with pytest.raises(ConnectionError, match="repository is unchanged"):
        new.push_to_hub("alice/fragile")
    assert api.model_info("alice/fragile").sha == before
    assert _same_weights(draft, DSparkDraftModel.from_pretrained("alice/fragile"))
    dropped = [r for r in hub.requests if r[2] == 0]
    assert len(dropped) == (2 if mode == "lfs" else 1)

    after = new.push_to_hub("alice/fragile").oid
    assert after != before and api.model_info("alice/fragile").sha == after
    assert sorted(api.list_repo_files("alice/fragile")) == REPO_FILES
    loaded = DSparkDraftModel.from_pretrained("alice/fragile", target=target)
    assert _same_weights(new, loaded) and torch.equal(_generate(target, loaded), _generate(target))
    if mode == "lfs":  # every LFS object reached the server once: what arrived before the drop was not re-sent
        oids = [r[1].split("?")[0].rsplit("/", 1)[1] for r in hub.requests if r[0] == "PUT" and r[2] == 200]
        assert len(oids) == len(set(oids)) and loaded_sha256(api) in oids


def loaded_sha256(api) -> str:
    return api.get_paths_info("alice/fragile", ["model.safetensors"])[0].lfs.sha256


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_push_and_pull(hub, target, draft, tmp_path, capsys):
    local = tmp_path / "draft"
    draft.save_pretrained(local)
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    (tmp_path / "eval.json").write_text(json.dumps({"gsm8k": {"tau": 3.0}}))
    (tmp_path / "train.yaml").write_text("learning_rate: 0.0006\nepochs: 2\n")

    assert cli.main(["push", str(local), "alice/cli-draft", "--eval-results", str(tmp_path / "eval.json"),
                     "--training-config", str(tmp_path / "train.yaml"), "--private"]) == 0  # fmt: skip
    assert "alice/cli-draft" in capsys.readouterr().out
    card = ModelCard.load("alice/cli-draft")
    assert "| gsm8k | 3 |" in card.text and "epochs: 2" in card.text and HfApi().model_info("alice/cli-draft").private
    assert cli.main(["pull", "alice/cli-draft", "--local-dir", str(tmp_path / "pulled")]) == 0
    assert "dspark" in capsys.readouterr().out
    assert _same_weights(draft, DSparkDraftModel.from_pretrained(tmp_path / "pulled"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the local target folder's name differs from the recorded target id
        args = ["push", str(local), "alice/cli-deepspec", "--format", "deepspec", "--target", str(target_dir)]
        assert cli.main(args) == 0
    assert cli.main(["pull", "alice/cli-deepspec", "--local-dir", str(tmp_path / "conv"), "--convert"]) == 0
    converted = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert converted["model_type"] == "dspark"
    assert "embed_tokens.weight" not in load_file(tmp_path / "conv" / "model.safetensors")
    assert _same_weights(draft, DSparkDraftModel.from_pretrained(tmp_path / "conv"))
    assert cli.main(["pull", "alice/cli-deepspec", "--convert"]) == 2  # a user error: one line, status 2
    assert "--convert needs --local-dir" in capsys.readouterr().err
