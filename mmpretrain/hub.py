"""Uploads to the Hugging Face Hub, for the trainer (``hub.push_every`` checkpoints) and the export
(``--push-to-hub``). The token is huggingface_hub's business (``HF_TOKEN`` or the saved login): this
module never reads, prints or writes it."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub


def push_folder(folder: str | Path, repo_id: str, *, private: bool = True, revision: str | None = None,
                path_in_repo: str | None = None, commit_message: str = "Upload mmpretrain export",
                allow_patterns: list[str] | None = None) -> str:
    """Create the model repo if needed and upload ``folder`` (into ``path_in_repo``; only
    ``allow_patterns`` when given); returns the commit URL."""
    huggingface_hub.create_repo(repo_id, private=private, exist_ok=True)
    info = huggingface_hub.upload_folder(repo_id=repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                         revision=revision, commit_message=commit_message,
                                         allow_patterns=allow_patterns)
    return str(getattr(info, "commit_url", info))
