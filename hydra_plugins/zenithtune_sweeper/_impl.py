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

from zenithtune import record, settings, signals, slurm
from zenithtune import study as zstudy
from zenithtune.app import TrialFailure
from zenithtune.errors import StudyFailed, StudyInterrupted, UserError, ZenithtuneError
from zenithtune.inject import inject
from zenithtune.job import Job, build_job, memory_limits, space_report
from zenithtune.loop import Pending, StudyLoop, WaveInterrupted
from zenithtune.overrides import hydra_quote, key, resume_command, value
from zenithtune.processes import kill_leftovers
from zenithtune.progress import Progress
from zenithtune.record import TRIAL_INFO, TRIAL_LOG, Attr, Launched, Outcome
from zenithtune.resolvers import environ_command
from zenithtune.run import FailureKind
from zenithtune.settings import ZenithtuneConf
from zenithtune.tuned import tuned_yaml

NOT_STARTED = "not_started"  # the rule of a trial whose Slurm job never started (slurm.NotStarted)


def _storage_error(url: str, err: BaseException) -> UserError:
    while err.__cause__ is not None:  # Optuna wraps SQLAlchemy wraps sqlite3: the innermost says what is wrong
        err = err.__cause__
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
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.OptunaError, ImportError, OSError, ValueError,
            RuntimeError) as err:
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
        progress = Progress(total=conf.n_trials, metric=job.evaluator.metric_name, direction=job.evaluator.direction)
        self.progress, self.conf = progress, conf
        # Only trials no live worker beats for are failed (a worker sharing the study keeps its own).
        # What a killed tuner's trial left running is found by its marker (the trial dir, see app.task) and
        # killed before anything is launched, so a retried candidate never runs twice at once.
        liveness = zstudy.Liveness(study, conf.heartbeat_interval, conf.heartbeat_grace,
                                   on_stale=lambda n: self._stale(study, n))
        stale = liveness.fail_stale() + zstudy.close_waiting(study)
        prior = record.history(study)
        self._remember(study, job, conf, url)
        best = zstudy.best(prior, job.evaluator.direction)
        used = record.budget_used(prior)
        progress.header(job, space_report(job), self.strategy_name, url, resumed=len(prior), stale=stale,
                        best=best.value if best else None, used=used, limits=memory_limits(job))
        loop = StudyLoop(job, study, callbacks=progress, max_consecutive_skips=self.max_consecutive_skips,
                         launch_batch=self._launch_wave, parallel=conf.parallel_trials, liveness=liveness)
        # A candidate whose job Slurm never started says nothing about it: proposed again after a fix
        loop.start([o for o in prior if o.rules != [NOT_STARTED]])
        try:
            with signals.armed():  # SIGTERM / SIGHUP now take Ctrl-C's path (zenithtune.signals)
                why = loop.run(conf.n_trials, launched=used, fail_fast=conf.fail_fast)
                while self._await_others(study, liveness):  # a dead tuner's trial was failed: budget freed
                    why = loop.run(conf.n_trials, launched=used, fail_fast=conf.fail_fast)
        except KeyboardInterrupt:
            loop.abandon()  # a proposal asked but not yet told (Ctrl-C between trials)
            self._finish(study, job, conf, url, sweep_dir, progress, "interrupted")
            progress.interrupted(url, self._resume_hint(url), signals.reason())
            stop = StudyInterrupted("")
            stop.exit_code = signals.exit_code()  # 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
            raise stop from None
        except slurm.NotStarted:
            loop.abandon()  # the wave's trials were marked not launched: pruned, no budget spent
            progress.close()
            raise
        except ZenithtuneError:
            loop.abandon()  # a bad value reached a trial: the study stops with its one line, nothing left RUNNING
            raise
        finally:
            liveness.stop()
        return self._finish(study, job, conf, url, sweep_dir, progress, why)

    def _stale(self, study: optuna.Study, number: int) -> None:
        """A trial of a tuner that died: kill what it left running here (its marker); its Slurm jobs (the
        ids in its record) are cancelled when still alive, so the candidate never runs twice at once when
        it is retried, or, when they finished meanwhile, their measurement is recorded (`_recover`)."""
        trial_dir = self.sweep_dir / f"trial_{number}"
        kill_leftovers(str(trial_dir))
        trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        jobs = [str(j) for j in (trial.user_attrs.get(Attr.SLURM_JOBS) or [])] if trial is not None else []
        if not jobs or trial is None:
            return
        states = slurm.queue(jobs)
        if any(state in slurm.ALIVE for state, _ in states.values()):
            left = slurm.cancel(jobs)
            self.progress.line(f"  trial {number}: its tuner died; cancelled its Slurm job {', '.join(jobs)}"
                               + (f" (still alive: {', '.join(left)})" if left else ""))
            return
        run = slurm.collect(trial_dir)
        state = states.get(jobs[0], ("", ""))[0]
        if run is not None and (run.value is not None or run.kind) and slurm.outcome_kind(state) is None:
            new = self._recover(study, trial, run)
            self.progress.line(f"  trial {number}: its tuner died; its Slurm job {', '.join(jobs)} finished "
                               f"meanwhile: its result is recorded as trial {new}")

    @staticmethod
    def _recover(study: optuna.Study, trial: optuna.trial.FrozenTrial, run: Launched) -> int:
        """Record what a dead tuner's finished job measured, as a new trial of the same candidate (the
        stale one stays failed, read as interrupted); returns its number."""
        from optuna.trial import TrialState, create_trial

        facts = {Attr.LAUNCHED: True, Attr.KIND: run.kind, Attr.REASONS: [run.reason] if run.reason else None,
                 Attr.ARGV: run.argv, Attr.ENV: run.env, Attr.LOG: run.log, Attr.DURATION: run.duration,
                 Attr.MEASURED_GB: run.measured_gb, Attr.RESERVED_GB: run.reserved_gb,
                 Attr.NEEDED_GB: run.needed_gb, Attr.OUTSIDE_GB: run.outside_gb, Attr.RECOVERED_FROM: trial.number,
                 Attr.SPREAD: run.spread, Attr.N_VALUES: run.n_values, Attr.STOPPED_AFTER: run.stopped_after,
                 Attr.SAVED_S: run.saved_s}
        attrs = {**trial.user_attrs, **{k: v for k, v in facts.items() if v is not None}}
        ok = run.value is not None
        study.add_trial(create_trial(state=TrialState.COMPLETE if ok else TrialState.FAIL,
                                     value=run.value if ok else None, params=trial.params,
                                     distributions=trial.distributions, user_attrs=attrs))
        return max(t.number for t in study.get_trials(deepcopy=False))

    @staticmethod
    def _await_others(study: optuna.Study, liveness: zstudy.Liveness) -> bool:
        """Other workers sharing the study may still run trials: wait for them (or for their
        workers to be found dead), so every worker reports the same, final best. True when a dead
        worker's trial was failed meanwhile: it measured nothing, and its place in n_trials is free."""
        freed = False
        while any(t.user_attrs.get(Attr.LAUNCHED)
                  for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))):
            time.sleep(min(1.0, liveness.interval))
            freed = bool(liveness.fail_stale()) or freed
        return freed

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
                overrides.append(f"timeout={p.limit:.6g}")  # as computed: .1f once turned 0.04 into timeout=0
            # resolved here: a launcher's job process composes the config anew (its own ${zt.started:})
            overrides += [f"hydra.sweep.dir={hydra_quote(str(self.sweep_dir))}", f"hydra.sweep.subdir=trial_{p.number}"]
            batch.append(overrides)
        if slurm.uses_slurm(self.launcher):
            return self._slurm_wave(wave, batch)
        stops = signals.count()
        try:
            try:
                rets = self.launcher.launch(batch, initial_job_idx=wave[0].number)
            except KeyboardInterrupt:
                raise
            except Exception as err:  # noqa: BLE001  a launcher that lost a job (submitit: cancelled, killed at its time limit)
                if signals.count() != stops:  # a stop while Hydra composed the job, wrapped into its own error
                    raise KeyboardInterrupt from None
                return [self._lost(p, err) for p in wave]
            results = [self._result(ret) for ret in rets]
            if signals.count() != stops:  # a stop that did not come through as KeyboardInterrupt: honour it now
                raise KeyboardInterrupt
            return results
        except KeyboardInterrupt:
            signals.acknowledge()  # delivered here
            # What finished before the stop is in its trial.json (app.task writes it before it lets a stop through).
            raise WaveInterrupted([record.read_run(self.sweep_dir / f"trial_{p.number}" / TRIAL_INFO)
                                   for p in wave]) from None

    def _slurm_wave(self, wave: list[Pending], batch: list[list[str]]) -> list[Launched]:
        """One wave as Slurm jobs (zenithtune.slurm): job ids into the records, the queue's reason on
        screen, Slurm's end state deciding timeout / cancelled."""
        trials = {p.number: p for p in wave}
        numbers = [p.number for p in wave]

        def waiting(reason: str) -> None:
            self.progress.waiting(reason, numbers)

        jobs: list[str] = []

        def submitted(number: int, job: str) -> None:
            trials[number].trial.set_user_attr(Attr.SLURM_JOBS, [job])
            jobs.append(job)

        try:
            ends = slurm.run_wave(self.launcher, batch, numbers, queue_timeout=self.conf.slurm.queue_timeout,
                                  on_submitted=submitted, on_queue=waiting, hint=self._request_hint())
        except KeyboardInterrupt:
            if jobs:  # run_wave cancelled them and waited until squeue no longer lists them
                self.progress.line(f"  cancelled the wave's Slurm jobs {', '.join(jobs)}")
            raise
        except slurm.NotStarted as err:
            for p in wave:  # nothing ran: recorded as pruned by the abandon that follows, no budget spent
                p.trial.set_user_attr(Attr.LAUNCHED, False)
                p.trial.set_user_attr(Attr.REASONS, [f"not launched: {err}"])
                p.trial.set_user_attr(Attr.RULES, [NOT_STARTED])
            raise
        return [self._slurm_result(p, end) for p, end in zip(wave, ends)]

    def _request_hint(self) -> str:
        launcher = self.config.hydra.launcher
        gpus = launcher.get("gpus_per_node")
        return (f"asked per trial: nodes={launcher.get('nodes')}, gpus_per_node={gpus}, "
                f"cpus_per_task={launcher.get('cpus_per_task')}; "
                + ("slurm.gpus=false on a CPU-only or GRES-less cluster, " if gpus else "")
                + "slurm.cpus_per_task=N, n_gpus / gpus_per_node, or hydra.launcher.partition=...")

    def _slurm_result(self, p: Pending, end: slurm.Finished) -> Launched:
        trial_dir = self.sweep_dir / f"trial_{p.number}"
        kind = slurm.outcome_kind(end.state)
        if kind is None and end.ret is not None:
            run = self._result(end.ret)
            if run.value is None:  # a multi-node trial: the metric may be another node's
                other = slurm.collect(trial_dir)
                run = other if other is not None and other.value is not None else run
            return run
        run = slurm.collect(trial_dir) or Launched(None, log=str(trial_dir))
        run.value = None
        if kind == FailureKind.TIMEOUT.value:
            run.kind, run.reason = kind, f"Slurm ended job {end.job_id} at its time limit ({end.state})"
        elif kind == FailureKind.CANCELLED.value:
            run.kind, run.reason = kind, f"job {end.job_id} was cancelled (scancel) before it finished"
        else:
            run.kind = FailureKind.CRASH.value
            run.reason = f"job {end.job_id} ended {end.state}: {end.error}"
        return run

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
            out_dir = self._trial_dir(ret)
            log = out_dir / TRIAL_LOG if out_dir else None  # hydra_main appended the traceback to it
            where = f"; traceback in {log}" if log is not None and log.is_file() else ""
            run.value, run.kind, run.reason = None, FailureKind.CRASH.value, f"{type(err).__name__}: {err}{where}"
            run.log = run.log or (str(log) if log is not None else None)
        return run

    @staticmethod
    def _trial_dir(ret: JobReturn) -> Path | None:
        hydra_cfg = ret.hydra_cfg
        out_dir = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir") if hydra_cfg is not None else None
        return Path(str(out_dir)) if out_dir else None

    @classmethod
    def _trial_run(cls, ret: JobReturn) -> Launched | None:
        out_dir = cls._trial_dir(ret)
        return record.read_run(out_dir / TRIAL_INFO) if out_dir else None

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
                stop = f"; {why}" if "rerun with" in why else ""  # the loop's hint (a metric below its precision)
                raise StudyFailed(f"all {len(launched)} launched trials failed ({summary}); first log: {first_log}{stop}")
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
                              metric=job.evaluator.metric_name, strategy=self.strategy_name, study=where, name=name,
                              evaluator=dict(conf.evaluator))

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
