# SPDX-License-Identifier: Apache-2.0
"""``--model`` as a local directory or a Hugging Face Hub id, resolved to a local directory.

A Hub id is fetched into the Hugging Face cache (``HF_HUB_CACHE``/``HF_HOME``;
``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` are read by
``huggingface_hub`` itself), one file at a time with ``hf_hub_download``, and
only what the encode tier reads:

- ``config.json``, and the processor configs that exist
  (``preprocessor_config.json``, ``processor_config.json``,
  ``video_preprocessor_config.json``); never the tokenizer, the generation
  config or any code;
- ``model.safetensors.index.json``, then only the shards that hold a tensor
  under one of the family's vision prefixes (``VisionFamily.weight_prefixes``):
  a 7B VLM costs its vision shards, not its LM;
- without an index, ``model.safetensors`` whole (a single file cannot be
  fetched in part through the cache).

The branch or tag is resolved to a commit by the first request (the
``X-Repo-Commit`` of ``config.json``); every later file is fetched at that
commit, so a push to the branch mid-download cannot mix two revisions. When
the Hub cannot be reached (``HF_HUB_OFFLINE=1``, or a connection error), the
cache answers. A required file it lacks is a ``CheckpointError`` naming the id,
the revision and the cache; an optional one (the processor configs, the index)
is taken as absent, as transformers takes it: a cache filled by
``snapshot_download`` / ``hf download`` keeps no marker for the files a
repository lacks.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from epd_encoder.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

CONFIG = "config.json"
PROCESSOR_CONFIGS = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# org/name or name, as the Hub spells repo ids; anything else is only ever a path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


@dataclass(frozen=True)
class ResolvedModel:
    """Where the checkpoint lies locally; ``repo_id``/``commit`` are None for a local directory."""

    path: Path
    repo_id: str | None = None
    commit: str | None = None
    files: tuple[str, ...] = ()  # the repository files the directory holds for us

    @property
    def source(self) -> str:
        return str(self.path) if self.repo_id is None else f"{self.repo_id}@{self.commit}"


def is_hub_id(model: str) -> bool:
    """A string that no local path answers and that has the shape of a repo id."""
    return not Path(model).expanduser().exists() and bool(_REPO_ID.match(model)) and ".." not in model


def vision_shards(weight_map: dict[str, str], prefixes) -> list[str]:
    """The shard files holding at least one tensor under a vision prefix, sorted."""
    starts = tuple(p for p, _ in prefixes)
    return sorted({f for name, f in weight_map.items() if name.startswith(starts)})


def resolve(model: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
            endpoint: str | None = None) -> ResolvedModel:
    """``model`` as a local directory, downloading the vision part from the Hub if it is an id.

    ``cache_dir`` and ``endpoint`` default to huggingface_hub's (from the
    environment); tests pass their own.
    """
    local = Path(model).expanduser()
    if local.exists():
        if revision is not None:
            raise ConfigError(f"--revision {revision} applies to a Hub id, not the local directory {local}")
        if not local.is_dir():
            raise CheckpointError(f"--model {local} is a file, not a checkpoint directory")
        return ResolvedModel(local)
    if not is_hub_id(model):
        raise CheckpointError(f"checkpoint directory {local} does not exist (and {model!r} is not a Hub id)")
    return _Fetch(model, revision or "main", cache_dir, endpoint).run()


class _Fetch:
    """One resolution of a Hub id: every file at the commit the first one resolved to."""

    def __init__(self, repo_id: str, revision: str, cache_dir, endpoint) -> None:
        self.repo_id, self.revision = repo_id, revision
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.endpoint = endpoint
        self.at = revision  # becomes the commit once config.json is resolved
        self.unreachable = False  # set by the first connection error: the cache alone answers then

    def run(self) -> ResolvedModel:
        config = self._get(CONFIG)
        snapshot = config.parent
        # The cache lays files out as snapshots/<commit>/<name>, online and offline alike.
        self.at = snapshot.name
        files = [CONFIG]
        for name in PROCESSOR_CONFIGS:
            if self._get(name, optional=True) is not None:
                files.append(name)
        index = self._get(INDEX, optional=True)
        if index is None:
            where = " in the cache" if self.unreachable else ""
            log.info("%s: no %s%s: fetching %s whole", self.repo_id, INDEX, where, SINGLE)
            self._get(SINGLE)
            files.append(SINGLE)
        else:
            shards = self._shards(config, index)
            for shard in shards:
                self._get(shard)
            files += [INDEX, *shards]
        log.info("resolved %s@%s to commit %s: %s", self.repo_id, self.revision, self.at, ", ".join(files))
        return ResolvedModel(snapshot, self.repo_id, self.at, tuple(files))

    def _shards(self, config: Path, index: Path) -> list[str]:
        from epd_encoder.models.registry import get_family

        try:
            model_type = json.loads(config.read_text()).get("model_type", "")
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{self._name()}: unreadable {CONFIG} or {INDEX}: {e}") from e
        family = get_family(str(model_type))  # UnsupportedModel before any weight is fetched
        shards = vision_shards(weight_map, family.weight_prefixes)
        if not shards:
            raise CheckpointError(f"{self._name()}: no tensor in {INDEX} starts with a {family.name} "
                                  f"vision prefix ({', '.join(p for p, _ in family.weight_prefixes)})")
        skipped = len(set(weight_map.values())) - len(shards)
        log.info("%s: %d vision shard(s) to fetch, %d LM-only shard(s) skipped", self.repo_id, len(shards), skipped)
        return shards

    def _name(self) -> str:
        return f"{self.repo_id}@{self.revision}"

    def _absent(self, filename: str) -> None:
        log.info("%s: %s is not in the Hugging Face cache and the Hub cannot be reached: taken as absent "
                 "(optional)", self._name(), filename)
        return None

    def _get(self, filename: str, *, optional: bool = False) -> Path | None:
        """The cached path of ``filename``; None for an optional file the repository lacks."""
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
        from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                            LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        if self.at != self.revision:
            # A commit is immutable: whatever the cache holds for it (a file, or a 404
            # remembered) is final, so no request (nor its retries when unreachable) is made.
            cached = try_to_load_from_cache(self.repo_id, filename, cache_dir=self.cache_dir, revision=self.at)
            if isinstance(cached, str):
                return Path(cached)
            if cached is not None:  # the cache's "does not exist"
                if optional:
                    return None
                raise CheckpointError(f"{self._name()} has no {filename}")
            if self.unreachable and optional:  # no second round of retries for what may not exist
                return self._absent(filename)
        try:
            return Path(hf_hub_download(self.repo_id, filename, revision=self.at, cache_dir=self.cache_dir,
                                        endpoint=self.endpoint))
        except LocalEntryNotFoundError as e:  # first: a subclass of EntryNotFoundError
            self.unreachable = True
            if optional:
                return self._absent(filename)
            raise CheckpointError(
                f"{self._name()}: {filename} is not in the Hugging Face cache"
                f"{'' if self.cache_dir is None else f' ({self.cache_dir})'} and the Hub cannot be "
                f"reached (HF_HUB_OFFLINE=1, or a connection error: {e.__cause__ or e})") from e
        except EntryNotFoundError as e:  # the Hub answered: the repository has no such file
            if optional:
                return None
            raise CheckpointError(f"{self._name()} has no {filename}") from e
        except GatedRepoError as e:
            raise CheckpointError(f"{self._name()} is gated: accept its terms and set HF_TOKEN ({e})") from e
        except RevisionNotFoundError as e:
            raise CheckpointError(f"{self.repo_id} has no revision {self.revision!r}") from e
        except RepositoryNotFoundError as e:
            raise CheckpointError(f"{self.repo_id!r} is neither a local directory nor a model repository on "
                                  f"the Hub (or it is private and HF_TOKEN is not set)") from e
        except HfHubHTTPError as e:
            raise CheckpointError(f"{self._name()}: fetching {filename} failed: {e}") from e
