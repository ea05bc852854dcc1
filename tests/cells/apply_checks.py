"""Run in a fresh interpreter with a real vLLM and speculators: apply/revert/plan behaviour."""

from __future__ import annotations

import json
import os
import sys


def snapshot(modules: list[object]) -> dict[str, int]:
    return {f"{m.__name__}.{k}": id(v) for m in modules for k, v in vars(m).items()}  # type: ignore[attr-defined]


def declared_against_made(applied: list[str]) -> dict[str, list[str]]:
    """Each record's declared patch targets (Adapter.patches) resolved and compared with the patches
    apply() made: the driver's, and the worker-process side's on a scratch patcher (those adapters
    only run inside spec_compat's workers; their probes would say so here, so they are installed)."""
    import tempfile

    from spec_compat.adapters import speculators_code
    from spec_compat.adapters.unit import covers, target_owner
    from spec_compat.detect import detect
    from spec_compat.engine import STATE
    from spec_compat.options import Context, Options
    from spec_compat.patching import Patcher
    from spec_compat.registry import ADAPTERS, BY_ID

    made = list(STATE.patcher.patches)
    scratch = Patcher()
    ctx = Context(env=detect(), options=Options())
    ctx.worker = speculators_code.import_worker()
    with tempfile.TemporaryDirectory() as watchdog_dir:
        os.environ["SPEC_COMPAT_WATCHDOG_DIR"] = watchdog_dir  # where worker-stack-dump writes
        try:
            for adapter in ADAPTERS:
                if adapter.side == "worker-process":
                    adapter.install(ctx, scratch)
            made += scratch.patches
            applied = [*applied, *(a.id for a in ADAPTERS if a.side == "worker-process")]
            unresolved, unmatched = [], []
            for adapter in ADAPTERS:
                for target in adapter.patches:
                    try:
                        target_owner(target)
                    except (ImportError, AttributeError) as exc:
                        unresolved.append(f"{adapter.id}: {target}: {exc}")
                        continue
                    mine = [p for p in made if p.adapter_id == adapter.id and covers(target, p)]
                    if adapter.id in applied and not mine:
                        unmatched.append(f"{adapter.id}: {target}")
            undeclared = [
                f"{p.adapter_id}: {p.target}"
                for p in made
                if not any(covers(t, p) for t in BY_ID[p.adapter_id].patches)
            ]
        finally:
            scratch.revert()
            del os.environ["SPEC_COMPAT_WATCHDOG_DIR"]
    return {"targets_unresolved": unresolved, "targets_not_patched": unmatched, "patches_undeclared": undeclared}


def main() -> None:
    import spec_compat
    from spec_compat.calls import innermost

    out: dict[str, object] = {}
    planned = spec_compat.plan()
    import speculators.data_generation.custom_worker as worker
    import speculators.data_generation.vllm_hidden_states_generator as generator
    import transformers.configuration_utils as configuration_utils

    cls = generator.VllmHiddenStatesGenerator
    ext = worker.HiddenStatesWorkerExtension
    # plan() imported speculators through its temporary import adapters and left nothing behind
    pristine = (
        snapshot([generator, worker])
        | {f"cls.{k}": id(v) for k, v in vars(cls).items()}
        | {f"ext.{k}": id(v) for k, v in vars(ext).items()}
    )
    out["plan_left_torch_alias"] = "torch" in vars(configuration_utils)
    out["planned"] = planned.applied

    first = spec_compat.apply()
    second = spec_compat.apply()
    out["idempotent"] = first is second
    out["applied"] = first.applied
    out["preflight_ok"] = all(f.ok for f in first.preflight)
    out["request_is_adapter"] = generator.Request is not innermost(generator.Request)
    wrapped_generate = cls.generate
    from spec_compat.engine import STATE
    from spec_compat.registry import BY_ID

    patch_ids = {patch.adapter_id for patch in STATE.patcher.patches}
    out |= declared_against_made(first.applied)
    out["patch_ids_not_in_registry"] = sorted(patch_ids - set(BY_ID))
    out["applied_without_a_patch"] = sorted(set(first.applied) - patch_ids)
    # each record's speculators range is honoured: applied only inside it, reported when outside
    installed = first.env.speculators
    decisions = {d.id: d for d in first.decisions}
    out["speculators_installed"] = installed.raw
    out["applied_outside_range"] = sorted(
        a for a in first.applied if BY_ID[a].speculators_excludes(installed) is not None
    )
    out["excluded_by_range"] = sorted(
        d.id for d in first.decisions if not d.applies and "outside this adapter's range" in d.reason
    )
    out["range_excluded_expected"] = sorted(
        a.id for a in BY_ID.values() if a.id in decisions and a.speculators_excludes(installed) is not None
    )

    reverted = spec_compat.revert()
    after = (
        snapshot([generator, worker])
        | {f"cls.{k}": id(v) for k, v in vars(cls).items()}
        | {f"ext.{k}": id(v) for k, v in vars(ext).items()}
    )
    out["reverted_count"] = len(reverted)
    out["reverted_ids_not_in_registry"] = sorted({entry.split(": ", 1)[0] for entry in reverted} - set(BY_ID))
    out["revert_restores_identity"] = after == pristine
    out["revert_removes_alias"] = "torch" not in vars(configuration_utils)

    again = spec_compat.apply()
    out["reapply_same_adapters"] = again.applied == first.applied
    out["reapply_same_structure"] = type(cls.generate) is type(wrapped_generate) and innermost(
        generator.Request
    ) is innermost(generator.Request)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
