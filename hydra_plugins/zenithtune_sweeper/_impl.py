"""The zenithtune sweeper's work: build the job, open the study, run the loop through Hydra's launcher,
write best.yaml (and a tuned config when asked)."""
from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from zenithtune import record, settings, signals
from zenithtune import study as zstudy
from zenithtune.app import TrialFailure
from zenithtune.errors import StudyFailed, StudyInterrupted, UserError, ZenithtuneError
from zenithtune.inject import inject
from zenithtune.job import Job, build_job, space_report
from zenithtune.loop import Pending, StudyLoop
from zenithtune.overrides import hydra_quote, key, resume_command, value
from zenithtune.processes import kill_leftovers
from zenithtune.progress import Progress
from zenithtune.record import TRIAL_INFO, Attr, Launched, Outcome
from zenithtune.resolvers import environ_command
from zenithtune.run import FailureKind
from zenithtune.settings import ZenithtuneConf
from zenithtune.tuned import tuned_yaml


def _storage_error(url: str, err: BaseException) -> UserError:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return UserError(f"cannot use the study storage {zstudy.where(url)}: {first[:200]} "
                     f"(give a study.db path or an Optuna URL: sqlite:///..., postgresql://..., mysql://...)")


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(16)


def _open_ours(url: str, name: str, job: Job, conf: ZenithtuneConf) -> optuna.Study:
    """Open (or create) the study, refusing one zenithtune did not make, BEFORE anything is written
    into it: a storage error, an unreadable or foreign database, a multi-objective study or one that
    optimizes the other way is one line, and a foreign study never gets a trial of ours."""
    import sqlalchemy.exc

    direction = job.evaluator.direction
    db = zstudy.db_path(url)
    try:
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
            for place in (db if db.exists() else db.parent,):
                if not os.access(place, os.W_OK):
                    raise UserError(f"cannot write {place}: the study database and its folder must be writable "
                                    f"(choose another storage= / --db-path, or fix the permissions)")
            if db.exists() and db.stat().st_size and _head(db) != b"SQLite format 3\x00":
                raise UserError(f"{db} is not a SQLite database (truncated or overwritten?): "
                                f"move it away or choose another storage= / --db-path")
        storage = zstudy.open_storage(url, conf.heartbeat_interval, conf.heartbeat_grace)
        summaries = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
        existing = summaries.get(name)
        if existing is not None:
            where = zstudy.where(url)
            if len(existing.directions) != 1:
                raise UserError(f"study {name!r} in {where} is multi-objective ({len(existing.directions)} "
                                f"objectives); zenithtune needs its own: choose another study_name or storage")
            if zstudy.STUDY_ATTR not in existing.user_attrs and existing.n_trials:
                raise UserError(f"study {name!r} in {where} was not made by zenithtune ({existing.n_trials} "
                                f"trials without its record): choose another study_name or storage")
            theirs = existing.directions[0].name.lower()
            if theirs != direction:
                raise UserError(f"study {name!r} in {where} was created to {theirs} but the evaluator wants to "
                                f"{direction}: use a new storage")
        return zstudy.open_study(url, name, direction, job.strategy.sampler(),
                                 heartbeat_interval=conf.heartbeat_interval, grace_period=conf.heartbeat_grace)
    except ZenithtuneError:
        raise  # already one line (zenithtune.study says what is wrong with the storage)
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, OSError, ValueError, RuntimeError) as err:
        raise _storage_error(url, err) from None


def plain_command(command: list[str], preset: Mapping[str, Any], gbs: int) -> list[str]:
    """The command with every option the tuner injects taken out: what a resumed study must share."""
    from zenithtune.inject import inject
    from zenithtune.space import options_for

    return inject(command, {o: None for o in options_for(preset, {}, gbs)})


def command_difference(before: list[str], now: list[str]) -> str:
    """The words that differ between two commands, as a user reads them."""
    import shlex

    gone = [w for w in before if w not in now]
    added = [w for w in now if w not in before]
    if not gone and not added:
        return "the same words in another order"
    parts = ([f"it had {shlex.join(gone[:4])}"] if gone else []) + ([f"this run has {shlex.join(added[:4])}"] if added else [])
    return ", ".join(parts)


class StudyRunner:
    def __init__(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig,
                 max_consecutive_skips: int) -> None:
        self.config = config
        self.max_consecutive_skips = max_consecutive_skips
        self.launcher: Launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        self.arguments: list[str] = []

    def sweep(self, arguments: list[str]) -> Any:
        conf = settings.load(self.config)
        job = build_job(conf)
        # as the user selects it (strategy=heuristic), not the class behind it
        self.strategy_name = HydraConfig.get().runtime.choices.get("strategy") or type(job.strategy).__name__
        self.arguments = [a for a in arguments if not key(a).startswith("params.")]
        return self._run(job, conf)

    def _run(self, job: Job, conf: ZenithtuneConf) -> Any:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        self.sweep_dir = sweep_dir
        url = zstudy.storage_url(conf.storage) if conf.storage else zstudy.default_storage(sweep_dir)
        try:  # trial folders go under the sweep dir: a read-only place is one line now, not a traceback later
            sweep_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(sweep_dir, os.W_OK):
                raise PermissionError(f"{sweep_dir} is not writable")
        except OSError as err:
            raise UserError(f"cannot write the study folder {sweep_dir}: {err.strerror or err}; run from a writable "
                            f"folder or choose one (--output-dir / hydra.sweep.dir=...)") from None
        study = _open_ours(url, conf.study_name, job, conf)
        # Only trials no live worker beats for are failed (a worker sharing the study keeps its own).
        # What a killed tuner's trial left running is found by its marker (the trial dir, see app.task) and
        # killed before anything is launched, so a retried candidate never runs twice at once.
        liveness = zstudy.Liveness(study, conf.heartbeat_interval, conf.heartbeat_grace,
                                   on_stale=lambda n: kill_leftovers(str(sweep_dir / f"trial_{n}")))
        stale = liveness.fail_stale() + zstudy.close_waiting(study)
        prior = record.history(study)
        self._remember(study, job, conf, url)
        progress = Progress(total=conf.n_trials, metric=job.evaluator.metric_name, direction=job.evaluator.direction)
        best = zstudy.best(prior, job.evaluator.direction)
        used = record.budget_used(prior)
        progress.header(job, space_report(job), self.strategy_name, url, resumed=len(prior), stale=stale,
                        best=best.value if best else None, used=used)
        loop = StudyLoop(job, study, callbacks=progress, max_consecutive_skips=self.max_consecutive_skips,
                         launch_batch=self._launch_wave, parallel=conf.parallel_trials, liveness=liveness)
        loop.start(prior)
        try:
            with signals.armed():  # SIGTERM / SIGHUP now take Ctrl-C's path (zenithtune.signals)
                why = loop.run(conf.n_trials, launched=used, fail_fast=conf.fail_fast)
                self._await_others(study, liveness)
        except KeyboardInterrupt:
            loop.abandon()  # a proposal asked but not yet told (Ctrl-C between trials)
            self._finish(study, job, conf, url, sweep_dir, progress, "interrupted")
            progress.interrupted(url, self._resume_hint(url), signals.reason())
            stop = StudyInterrupted("")
            stop.exit_code = signals.exit_code()  # 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
            raise stop from None
        finally:
            liveness.stop()
        return self._finish(study, job, conf, url, sweep_dir, progress, why)

    @staticmethod
    def _await_others(study: optuna.Study, liveness: zstudy.Liveness) -> None:
        """Other workers sharing the study may still run trials: wait for them (or for their
        workers to be found dead), so every worker reports the same, final best."""
        while any(t.user_attrs.get(Attr.LAUNCHED)
                  for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))):
            time.sleep(min(1.0, liveness.interval))
            liveness.fail_stale()

    def _remember(self, study: optuna.Study, job: Job, conf: ZenithtuneConf, url: str) -> None:
        """What `zenithtune apply --db-path` needs to re-create a trial's run: the study's overrides
        and the command as given (None = the config's default command)."""
        before = study.user_attrs.get(zstudy.STUDY_ATTR) or {}
        plain = plain_command(job.command, conf.preset, job.ctx.gbs)
        new_study = "(another --db-path / storage)"
        for name, now in (("n_gpus", job.ctx.n_gpus), ("gbs", job.ctx.gbs)):
            if before.get(name) not in (None, now):  # its trials would not be comparable with these
                raise UserError(f"the study in {zstudy.where(url)} was made for {name}={before[name]}, this run "
                                f"says {name}={now}: resume with {name}={before[name]} or start a new study "
                                f"{new_study}")
        if before and before.get("model") != conf.model:
            raise UserError(f"the study in {zstudy.where(url)} was made for model={before.get('model')}, this run "
                            f"says model={conf.model}: resume with the same model= or start a new study "
                            f"{new_study}")
        if before.get("plain_command") not in (None, plain):
            raise UserError(f"the study in {zstudy.where(url)} was made for another command ("
                            f"{command_difference(before['plain_command'], plain)}; options the tuner injects do "
                            f"not count): resume with the same command or start a new study {new_study}")
        choices = HydraConfig.get().runtime.choices
        study.set_user_attr(zstudy.STUDY_ATTR, {
            "overrides": list(self.arguments), "command": environ_command(), "plain_command": plain,
            "n_gpus": job.ctx.n_gpus, "gbs": job.ctx.gbs, "model": conf.model,
            "preset": choices.get("preset"), "strategy": choices.get("strategy"),
            "metric": job.evaluator.metric_name})

    def _resume_hint(self, url: str) -> str:
        ov = self.config.hydra.overrides
        return resume_command(zstudy.where(url), list(ov.task), list(ov.hydra), environ_command())

    def _launch_wave(self, wave: list[Pending]) -> list[Launched]:
        """One wave through the selected hydra/launcher, in one call (submitit: K jobs at once). Each
        trial's folder is trial_<its number>, whatever the launcher numbers its jobs."""
        batch = []
        for p in wave:
            overrides = list(self.arguments) + [f"++params.{k}={value(v)}" for k, v in p.cand.items()]
            if p.limit is not None:
                overrides.append(f"timeout={p.limit:.1f}")
            # resolved here: a launcher's job process composes the config anew (its own ${zt.started:})
            overrides += [f"hydra.sweep.dir={hydra_quote(str(self.sweep_dir))}", f"hydra.sweep.subdir=trial_{p.number}"]
            batch.append(overrides)
        try:
            rets = self.launcher.launch(batch, initial_job_idx=wave[0].number)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001  a launcher that lost a job (submitit: cancelled, killed at its time limit)
            return [self._lost(p, err) for p in wave]
        return [self._result(ret) for ret in rets]

    def _lost(self, p: Pending, err: Exception) -> Launched:
        """A trial whose job returned nothing (scancel, Slurm's time limit, a node failure): what its
        entry function reported, if it got that far, else the launcher's reason."""
        run = record.read_run(self.sweep_dir / f"trial_{p.number}" / TRIAL_INFO)
        if run is not None and (run.value is not None or run.kind):
            return run
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        state = "TIMEOUT" if "TIMEOUT" in str(err) else "CANCELLED" if "CANCEL" in str(err) else None
        kind = FailureKind.TIMEOUT.value if state == "TIMEOUT" else FailureKind.CRASH.value
        return Launched(None, kind, f"the launcher lost the job ({type(err).__name__}: {text})"
                        + (f"; the job was {state.lower()}" if state else ""),
                        log=str(self.sweep_dir / f"trial_{p.number}"))

    def _result(self, ret: JobReturn) -> Launched:
        run = self._trial_run(ret) or Launched(None)
        if ret.status == JobStatus.COMPLETED:
            run.value, run.kind, run.reason = float(ret.return_value), None, ""
            return run
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # Hydra's "Error executing job" line: we report it
                ret.return_value  # noqa: B018  (the property re-raises what the entry function raised)
        except KeyboardInterrupt:
            raise
        except TrialFailure as err:
            run.value, run.kind, run.reason = None, err.kind, err.reason
        except ZenithtuneError:
            raise  # a bad value reached the entry function: the study stops with its one line
        except Exception as err:  # noqa: BLE001  a bug or bad config inside the entry function: the message is the clue
            run.value, run.kind, run.reason = None, FailureKind.CRASH.value, f"{type(err).__name__}: {err}"
        return run

    @staticmethod
    def _trial_run(ret: JobReturn) -> Launched | None:
        hydra_cfg = ret.hydra_cfg
        out_dir = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir") if hydra_cfg is not None else None
        return record.read_run(Path(str(out_dir)) / TRIAL_INFO) if out_dir else None

    def _finish(self, study: optuna.Study, job: Job, conf: ZenithtuneConf, url: str, sweep_dir: Path,
                progress: Progress, why: str) -> Outcome | None:
        outcomes = record.history(study)
        best = zstudy.best(outcomes, job.evaluator.direction)
        launched = record.launched(outcomes)
        progress.footer(outcomes, best, why)
        if best is None:
            if why == "interrupted":
                return None
            if launched:
                summary = ", ".join(f"{k}: {n}" for k, n in sorted(record.kind_counts(launched).items()))
                first_log = next((o.log for o in launched if o.log), None)
                raise StudyFailed(f"all {len(launched)} launched trials failed ({summary}); first log: {first_log}")
            raise StudyFailed("no candidate could be launched: every proposal was invalid or predicted to run out "
                              "of memory (see the space report above); check gpu_memory_gb, n_gpus and gbs")
        where = zstudy.where(url)
        db = zstudy.db_path(url)
        out = db.parent if db else sweep_dir  # a journal or a server: this worker's own study folder
        out.mkdir(parents=True, exist_ok=True)
        model = conf.model or (job.ctx.model.name if job.ctx.model.name != "command" else None)
        plain = inject(job.command, {o: None for o in job.space.options(best.candidate)})  # as the user wrote it

        def tuned(name: str | None) -> str:
            return tuned_yaml(best, command=plain, n_gpus=job.ctx.n_gpus, gbs=job.ctx.gbs, model=model,
                              metric=job.evaluator.metric_name, strategy=self.strategy_name, study=where, name=name)

        (out / "best.yaml").write_text(tuned(None))
        progress.wrote(out / "best.yaml")
        name = conf.save_tuned
        if name:
            target = Path.cwd() / "conf" / "tuned" / f"{name}.yaml"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(tuned(str(name)))
            progress.wrote(target, f"commit it; apply: zenithtune apply --tuned {name} -- <your command>, "
                                   f"or python -m zenithtune tuned={name} -- <your command>")
        if why != "interrupted":
            progress.line(f"analyze: zenithtune analyze {where}")
        return best
