"""The zenithtune sweeper's work: build the job, open the study, run the loop through Hydra's launcher,
write best.yaml (and a tuned config when asked)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from zenithtune import app, study as zstudy
from zenithtune.app import TrialFailure, UserError, fail
from zenithtune.job import Job, build_job
from zenithtune.loop import Launched, StudyLoop
from zenithtune.progress import Progress


def _override_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


class StudyRunner:
    def __init__(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig,
                 max_consecutive_skips: int) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.max_consecutive_skips = max_consecutive_skips
        self.launcher: Launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        self.arguments: list[str] = []

    def sweep(self, arguments: list[str]) -> Any:
        try:
            job = build_job(self.config)
        except ValueError as e:  # UserError, ModelInfoError: one line, no traceback
            fail(str(e))
        self.arguments = [a for a in arguments if not a.lstrip("+").startswith("params.")]
        return self._run(job)

    def _run(self, job: Job) -> Any:
        cfg = self.config
        sweep_dir = Path(str(cfg.hydra.sweep.dir)).resolve()
        url = zstudy.storage_url(str(cfg.storage)) if cfg.get("storage") else zstudy.default_storage(sweep_dir)
        db = zstudy.db_path(url)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        study = zstudy.open_study(url, str(cfg.study_name), job.evaluator.direction, job.strategy.sampler())
        if study.direction.name.lower() != job.evaluator.direction:
            fail(f"study {cfg.study_name!r} in {url} was created to {study.direction.name.lower()} but the "
                 f"evaluator wants to {job.evaluator.direction}: use a new storage")
        stale = zstudy.close_stale(study)
        prior = zstudy.history(study)
        self._remember(study, job, url)
        n_trials = int(cfg.n_trials)
        progress = Progress(total=n_trials, metric=job.evaluator.metric_name, direction=job.evaluator.direction)
        best = zstudy.best_trial(study)
        progress.header(job, url, resumed=len(prior), stale=stale, best=best.value if best else None,
                        used=zstudy.launched_count(study))
        loop = StudyLoop(job, study, self._launch, progress, self.max_consecutive_skips)
        loop.start(prior)
        try:
            why = loop.run(n_trials, launched=zstudy.launched_count(study), fail_fast=int(cfg.get("fail_fast") or 0))
        except KeyboardInterrupt:
            zstudy.close_stale(study)  # a proposal asked but not yet told (Ctrl-C between trials)
            self._finish(study, job, url, sweep_dir, progress, "interrupted")
            progress.interrupted(url, self._resume_hint(url))
            raise SystemExit(130)
        return self._finish(study, job, url, sweep_dir, progress, why)

    def _remember(self, study: Any, job: Job, url: str) -> None:
        """What `zenithtune apply --db-path` needs to re-create a trial's run: the study's overrides
        and the command as given (None = the config's default command)."""
        from hydra.core.hydra_config import HydraConfig

        before = study.user_attrs.get(zstudy.STUDY_ATTR) or {}
        for key, now in (("n_gpus", job.ctx.n_gpus), ("gbs", job.ctx.gbs)):
            if before.get(key) not in (None, now):  # its trials would not be comparable with these
                fail(f"the study in {zstudy.db_path(url) or url} was made for {key}={before[key]}, this run says "
                     f"{key}={now}: resume with "
                     f"{key}={before[key]} or start a new study (another --db-path / storage)")
        choices = HydraConfig.get().runtime.choices
        study.set_user_attr(zstudy.STUDY_ATTR, {
            "overrides": list(self.arguments), "command": app.environ_command(),
            "n_gpus": job.ctx.n_gpus, "gbs": job.ctx.gbs, "model": self.config.get("model"),
            "preset": choices.get("preset"), "strategy": choices.get("strategy"),
            "metric": job.evaluator.metric_name})

    def _resume_hint(self, url: str) -> str:
        from zenithtune.cli import resume_command

        ov = self.config.hydra.overrides
        return resume_command(url, list(ov.task), list(ov.hydra), app.environ_command())

    def _launch(self, number: int, cand: dict, timeout: float | None) -> Launched:
        overrides = list(self.arguments) + [f"++params.{k}={_override_value(v)}" for k, v in cand.items()]
        if timeout is not None:
            overrides.append(f"timeout={timeout:.1f}")
        ret = self.launcher.launch([overrides], initial_job_idx=number)[0]
        info = self._trial_info(ret)
        attrs = {k: info[k] for k in ("argv", "env", "log") if k in info}
        measured = info["peak_memory_mb"] / 1024.0 if info.get("peak_memory_mb") else None
        if ret.status == JobStatus.COMPLETED:
            return Launched(float(ret.return_value), duration=info.get("duration"), measured_gb=measured, attrs=attrs)
        err = ret._return_value
        if isinstance(err, KeyboardInterrupt):
            raise err
        if isinstance(err, TrialFailure):
            return Launched(None, err.kind, err.reason, info.get("duration"), measured, attrs)
        if isinstance(err, UserError):
            fail(str(err))
        # A bug or bad config inside the entry function: keep the message, it is the clue.
        return Launched(None, "crash", f"{type(err).__name__}: {err}", info.get("duration"), measured, attrs)

    @staticmethod
    def _trial_info(ret: Any) -> dict:
        try:
            out_dir = Path(str(ret.hydra_cfg.hydra.runtime.output_dir))
            return json.loads((out_dir / app.TRIAL_INFO).read_text())
        except (OSError, ValueError, AttributeError):
            return {}

    def _finish(self, study: Any, job: Job, url: str, sweep_dir: Path, progress: Progress, why: str) -> Any:
        best = zstudy.best_trial(study)
        launched = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("launched")]
        progress.footer(study, best, why)
        if best is None:
            if why == "interrupted":
                return None
            if launched:
                kinds: dict[str, int] = {}
                for t in launched:
                    k = t.user_attrs.get("kind", "?")
                    kinds[k] = kinds.get(k, 0) + 1
                first_log = next((t.user_attrs.get("log") for t in launched if t.user_attrs.get("log")), None)
                summary = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
                fail(f"all {len(launched)} launched trials failed ({summary}); first log: {first_log}", code=1)
            fail("no candidate could be launched: every proposal was invalid or predicted to run out of memory "
                 "(see the space report above); check gpu_memory_gb, n_gpus and gbs", code=1)
        where = str(zstudy.db_path(url) or url)
        out = zstudy.db_path(url).parent if zstudy.db_path(url) else sweep_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "best.yaml").write_text(job.tuned_yaml(best, where, name=None))
        progress.wrote(out / "best.yaml")
        name = self.config.get("save_tuned")
        if name:
            target = Path.cwd() / "conf" / "tuned" / f"{name}.yaml"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(job.tuned_yaml(best, where, name=str(name)))
            progress.wrote(target, f"commit it; apply: zenithtune apply --tuned {name} -- <your command>, "
                                   f"or python -m zenithtune tuned={name} -- <your command>")
        if why != "interrupted":
            progress.line(f"analyze: zenithtune analyze {where}")
        return best
