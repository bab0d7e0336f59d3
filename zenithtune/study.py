"""Optuna storage for a study: where it lives, opening it, sharing it between workers, its best trial.

What one trial records is `zenithtune.record`'s business; this module deals with the study and its
storage, and is the one place a storage a user names is parsed and opened:

- `sqlite:///<file>` (or a study.db path, or a folder holding one): one host. Opened in WAL mode with
  a long busy timeout, so several tuner processes on that host wait for each other's writes instead
  of failing with "database is locked".
- `journal:<file>`: Optuna's JournalStorage on a JournalFileBackend, for a file on a shared (NFS)
  file system, where sqlite's locking is not to be trusted. Optuna has no URL for it.
- `postgresql://user:pass@host/db` (pip install 'zenithtune[cluster]'): many hosts.

Several tuner processes ("workers") may share one study; three things make that safe:
- liveness: every worker beats for the trials it runs (Optuna's RDB heartbeat; on a journal, a
  trial system attr). A RUNNING trial whose beat is older than the grace period belongs to a dead
  worker and is failed (`fail_stale`); `record.outcome_of` reads it as `interrupted`, which does not
  count against n_trials and may be launched again. A live worker's trial is never touched.
- claims: before a launch, the candidate is claimed in the storage (`Claims.claim`), atomically: a
  unique row in the database, or an append under the journal's file lock. A second worker proposing
  the same candidate is refused and records it as a duplicate; a claim held by an interrupted trial
  may be taken over.
- budget: n_trials counts the launched trials in the storage, re-counted right before each launch.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.trial import TrialState

from zenithtune import record
from zenithtune.errors import UserError
from zenithtune.record import Attr, Outcome

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Study user attr the sweeper sets: {overrides, command, n_gpus, gbs, model, preset, strategy, metric}
# — what `zenithtune apply --db-path` and `zenithtune analyze` need to re-create and describe a trial.
STUDY_ATTR = "zenithtune"
DB_NAME = "study.db"
JOURNAL = "journal:"
# Trial system attrs of the liveness rule (ours, not Optuna's).
BEAT_ATTR = "zenithtune:beat"  # time.time() of the last beat (journal), or True: Optuna's heartbeat beats it
SQLITE_BUSY_S = 120  # a writer waits this long for another process's write lock before failing
FORMS = ("sqlite:///<file> (or a study.db path or its folder)", "journal:<file> (a file on a shared file system)",
         "postgresql://user:password@host:port/db")


def storage_url(value: str | os.PathLike) -> str:
    """The one reader of a storage a user names (`storage=`, `--db-path`, `analyze DB`): an Optuna
    URL as it is; `journal:<path>` with the path made absolute; a study.db file, or a folder holding
    one, as a sqlite URL."""
    text = str(value)
    if text.startswith(JOURNAL) and "://" not in text:
        rest = text[len(JOURNAL):]
        if not rest:
            raise UserError("storage=journal: names no file: give one on a shared file system, "
                            "e.g. storage=journal:/shared/tune/study.journal")
        return JOURNAL + str(Path(rest).expanduser().resolve())
    if "://" in text:
        return text
    path = Path(text).expanduser().resolve()
    if path.is_dir() or (not path.suffix and not path.exists() and text.endswith(("/", os.sep))):
        path = path / DB_NAME
    return f"sqlite:///{path}"


def default_storage(sweep_dir: str | os.PathLike) -> str:
    return storage_url(Path(sweep_dir).resolve() / DB_NAME)


def db_path(url: str) -> Path | None:
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def journal_path(url: str) -> Path | None:
    return Path(url[len(JOURNAL):]) if url.startswith(JOURNAL) else None


def where(url: str) -> str:
    """A storage as a user reads it: the db file for sqlite, else the URL (its password hidden)."""
    path = db_path(url)
    if path is not None:
        return str(path)
    if "://" in url and "@" in url:
        scheme, _, rest = url.partition("://")
        creds, _, host = rest.rpartition("@")
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else url
    return url


# --- opening --------------------------------------------------------------------------------------
_STORAGES: dict[tuple, optuna.storages.BaseStorage] = {}


def open_storage(url: str, heartbeat_interval: int | None = None,
                 grace_period: int | None = None, *, read_only: bool = False) -> optuna.storages.BaseStorage:
    """The storage behind a URL, opened once per process; a URL a user can fix -> one UserError line.
    ``read_only`` (a sqlite file only): opened as an immutable file, for reading a study kept where
    nothing may be written (a read-only folder or mount): sqlite's WAL mode would otherwise need its
    -shm file next to it."""
    cache_key = (url, heartbeat_interval, grace_period, read_only)
    if cache_key in _STORAGES:
        return _STORAGES[cache_key]
    journal = journal_path(url)
    if journal is not None:
        storage: optuna.storages.BaseStorage = _journal(journal)
    elif "://" not in url:
        raise UserError(f"storage={url} is not a storage: use one of {'; '.join(FORMS)}")
    else:
        storage = _rdb(url, heartbeat_interval, grace_period, read_only=read_only)
    _STORAGES[cache_key] = storage
    return storage


@atexit.register
def close_storages() -> None:
    """Close the database connections this process opened. A sqlite study's writes sit in its -wal file
    until the last connection closes, which merges them into study.db; left to the interpreter's exit,
    that close did not always happen (CI: a study's db read from a read-only folder then held no tables,
    as a read-only reader cannot merge the -wal)."""
    for storage in _STORAGES.values():
        engine = getattr(storage, "engine", None)
        if engine is not None:
            engine.dispose()
    _STORAGES.clear()


def _journal(path: Path) -> optuna.storages.BaseStorage:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    if not path.parent.is_dir():
        raise UserError(f"storage=journal:{path}: the folder {path.parent} does not exist; create it "
                        f"(on a file system every worker sees)")
    # The open lock (O_EXCL create) works on NFSv3+, where fcntl locks are unreliable.
    return JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


def _rdb(url: str, heartbeat_interval: int | None, grace_period: int | None, *,
         read_only: bool = False) -> optuna.storages.BaseStorage:
    from optuna.storages import RDBStorage
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    scheme = url.split("://", 1)[0]
    engine_kwargs: dict[str, Any] = {}
    sqlite = db_path(url)
    shown = url
    if scheme.startswith("sqlite"):
        if sqlite is None:
            raise UserError(f"storage={url}: a sqlite storage names a file: sqlite:////abs/path/study.db")
        if not sqlite.parent.is_dir():
            raise UserError(f"storage={url}: the folder {sqlite.parent} does not exist")
        if read_only:
            _sqlite_check(_sqlite_uri(sqlite), sqlite)
            url = f"sqlite:///{_sqlite_uri(sqlite)}&uri=true"  # SQLAlchemy passes uri=true to sqlite3
        else:
            _sqlite_wal(sqlite)
            engine_kwargs["connect_args"] = {"timeout": SQLITE_BUSY_S}
    elif scheme.startswith(("postgresql", "postgres")):
        engine_kwargs.update(pool_pre_ping=True, connect_args={"connect_timeout": 10})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        last: Exception | None = None
        for attempt in range(8):
            try:
                return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval,
                                  grace_period=grace_period)
            except (ModuleNotFoundError, ImportError) as e:
                raise UserError(f"storage={where(shown)} needs a database driver that is not installed ({e.name or e}): "
                                f"pip install 'zenithtune[cluster]' (PostgreSQL) or the driver for {scheme}") from None
            except (ArgumentError, NoSuchModuleError, ValueError) as e:
                raise UserError(f"storage={where(shown)} is not a storage URL zenithtune can open "
                                f"({str(e).splitlines()[0]}): use one of {'; '.join(FORMS)}") from None
            except SQLAlchemyError as e:
                # Workers starting together race to create Optuna's tables ("table studies already
                # exists", a unique violation on PostgreSQL's catalog): the loser retries and finds them.
                last = e
                if any(w in str(e) for w in ("already exists", "UniqueViolation", "UNIQUE constraint", "locked",
                                              "duplicate key")):
                    time.sleep(0.2 * (attempt + 1))
                    continue
                break
        detail = str(getattr(last, "orig", None) or last).strip().splitlines()[0] if last else "?"
        raise UserError(f"cannot open storage {where(shown)}: {detail}; check that the database server is up "
                        f"and reachable from this host, and the URL's user, password and database") from None


def _sqlite_wal(path: Path) -> None:
    """WAL lets readers work while one process writes; it is a property of the file, set once.
    A damaged file (a page overwritten) is refused here, in one line, before Optuna reads it."""
    import sqlite3

    # Switching the journal mode needs the file to itself and does not wait out sqlite's busy timeout: four
    # workers opening one new study at once saw "database is locked" (CI, a busy machine). The mode is read
    # first (set once, it is set for good) and the switch retried with a growing pause.
    for attempt in range(8):
        try:
            with sqlite3.connect(str(path), timeout=SQLITE_BUSY_S) as conn:
                _check_intact(conn, path)
                if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == 7:
                raise UserError(f"cannot open sqlite storage {path}: {e}") from None
            time.sleep(0.2 * (attempt + 1))
        except sqlite3.Error as e:
            raise UserError(f"cannot open sqlite storage {path}: {e}") from None


def _sqlite_uri(path: Path) -> str:
    """sqlite's URI for a file opened read-only and immutable (no -shm, -wal or lock file is made)."""
    from urllib.parse import quote

    return f"file:{quote(str(path))}?mode=ro&immutable=1"


def _unmerged(path: Path) -> bool:
    """Whether a sqlite file has writes still in its -wal file (an immutable read would not see them)."""
    wal = path.with_name(path.name + "-wal")
    return wal.is_file() and wal.stat().st_size > 0


def _sqlite_check(uri: str, path: Path) -> None:
    import sqlite3

    try:
        with sqlite3.connect(uri, uri=True) as conn:
            _check_intact(conn, path)
    except sqlite3.Error as e:
        raise UserError(f"cannot open sqlite storage {path}: {e}") from None


def writable(path: Path) -> bool:
    """Whether a sqlite file and its folder can be written (its journal and -shm files live there)."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def _check_intact(conn: Any, path: Path) -> None:
    """sqlite's own page and index check (quick_check: read-only, linear in the file's size, which is
    small for a study); without it a damaged page surfaces as chained tracebacks in the middle of a run."""
    problems = [line for row in conn.execute("PRAGMA quick_check(3)") for line in str(row[0]).splitlines()
                if line.strip() and not line.startswith("***")]  # "*** in database main ***" heads the list
    if problems and problems != ["ok"]:
        raise UserError(f"{path} is damaged ({problems[0]}): move it away and start a new study, or "
                        f"recover its rows with sqlite3 {path.name} .recover")


def open_study(url: str, name: str, direction: Literal["maximize", "minimize"], sampler: optuna.samplers.BaseSampler | None = None,
               create: bool = True, heartbeat_interval: int | None = None,
               grace_period: int | None = None) -> optuna.Study:
    storage = open_storage(url, heartbeat_interval, grace_period)
    if create:
        for attempt in range(8):
            try:
                return optuna.create_study(storage=storage, study_name=name, direction=direction,
                                           sampler=sampler, load_if_exists=True)
            except optuna.exceptions.DuplicatedStudyError:  # created by another worker in between
                time.sleep(0.1 * (attempt + 1))
    return optuna.load_study(storage=storage, study_name=name, sampler=sampler)


def load_existing(value: str, study_name: str | None = None) -> tuple[optuna.Study, str]:
    """An existing study a user points at (`analyze DB`, `apply --db-path DB`), read-only use."""
    url = storage_url(value)
    path = db_path(url) or journal_path(url)
    if path is not None and not path.is_file():
        raise UserError(f"{value}: no such study database ({path}); studies are in outputs/study_*/study.db")
    sqlite = db_path(url)
    read_only = sqlite is not None and not writable(sqlite)
    if sqlite is not None and read_only and _unmerged(sqlite):
        raise UserError(f"{sqlite} has writes not yet merged from {sqlite.name}-wal (a study still running, or "
                        f"one that was killed), which a read-only folder cannot merge: copy the folder somewhere "
                        f"writable and read the copy, or let the study finish")
    storage = open_storage(url, read_only=read_only)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage=storage)]
    if not names:
        raise UserError(f"{where(url)} holds no study: run `zenithtune optimize` (or python -m zenithtune -m) first")
    name = study_name
    if name is None:
        if len(names) > 1:
            raise UserError(f"{where(url)} holds several studies ({', '.join(names)}): pass --study-name")
        name = names[0]
    elif name not in names:
        raise UserError(f"{where(url)} has no study {name!r}; it holds: {', '.join(names)}")
    return optuna.load_study(storage=storage, study_name=name), url


# --- Optuna's internals, in one place -----------------------------------------------------------------
OPTUNA_WRITTEN_FOR = "5."  # the Optuna series `Internals` was written against (tests/test_study.py pins it)


class Internals:
    """What zenithtune reads of a study that Optuna keeps private: the storage behind a study, a trial's
    storage id, the study's id, whether Optuna's own heartbeat runs, the engine of an RDB storage and the
    file of a journal. Liveness and claims need them and Optuna offers no public name; nothing else in
    zenithtune touches an underscored Optuna attribute, so an Optuna upgrade is checked here."""

    def __init__(self, study: optuna.Study):
        self.study = study
        self.storage = study._storage
        self.study_id: int = study._study_id

    @staticmethod
    def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
        return int(trial._trial_id)

    def native_heartbeat(self) -> bool:
        """Optuna's RDB heartbeat is on (the storage was opened with a heartbeat interval)."""
        from optuna.storages._heartbeat import is_heartbeat_enabled

        return is_heartbeat_enabled(self.storage)

    def beat(self, trial_id: int, native: bool) -> None:
        """A beat for the trial: Optuna's own heartbeat (`native`), marked by `BEAT_ATTR` True, or the
        time of the beat in `BEAT_ATTR`."""
        if native:
            self.storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]
            self.storage.set_trial_system_attr(trial_id, BEAT_ATTR, True)
        else:
            self.storage.set_trial_system_attr(trial_id, BEAT_ATTR, time.time())

    def fail(self, trial_id: int) -> None:
        self.storage.set_trial_state_values(trial_id, state=TrialState.FAIL)

    def engine(self) -> Any:
        """The SQLAlchemy engine of an RDB storage (sqlite, PostgreSQL), else None."""
        from optuna.storages import RDBStorage

        inner = getattr(self.storage, "_backend", self.storage)  # optuna wraps RDBStorage in a cache
        return getattr(inner, "engine", None) if isinstance(inner, RDBStorage) else None

    def journal_file(self) -> Path | None:
        """The file of a journal storage, else None."""
        from optuna.storages import JournalStorage

        if not isinstance(self.storage, JournalStorage):
            return None
        return Path(str(getattr(self.storage._backend, "_file_path")))  # noqa: B009  (no public name)


# --- many workers, one study ------------------------------------------------------------------------

class Liveness:
    """Beats for the trials this worker runs, and fails the RUNNING trials of dead workers.

    On an RDB storage opened with a heartbeat interval, Optuna's heartbeat does it (`record_heartbeat`,
    `fail_stale_trials`); elsewhere (journal, in-memory) a trial system attr carries the beat. A
    RUNNING trial that never beat (a tuner of an older version) counts as beating at its start."""

    def __init__(self, study: optuna.Study, interval: float, grace: float,
                 on_stale: Callable[[int], object] | None = None):
        self.study = study
        self.on_stale = on_stale  # called with each trial failed as stale (e.g. kill what it left running)
        self.interval = float(interval)
        self.grace = float(grace)
        self._optuna = Internals(study)
        self.native = self._optuna.native_heartbeat()
        self._mine: dict[int, int] = {}  # trial number -> trial id, RUNNING here
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, trial: optuna.Trial) -> None:
        trial_id = Internals.trial_id(trial)
        with self._lock:
            self._mine[trial.number] = trial_id
        self._beat_one(trial_id)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zenithtune-heartbeat", daemon=True)
            self._thread.start()

    def release(self, number: int) -> None:
        with self._lock:
            self._mine.pop(number, None)

    def mine(self) -> list[int]:
        with self._lock:
            return sorted(self._mine)

    def stop(self) -> None:
        self._stop.set()

    def _beat_one(self, trial_id: int) -> None:
        try:
            self._optuna.beat(trial_id, self.native)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # told in between (or failed as stale: the beat came too late)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for tid in list(self._mine.values()):
                try:
                    self._beat_one(tid)
                except Exception:  # noqa: BLE001  a storage hiccup: the next beat retries; grace covers it
                    pass

    def fail_stale(self) -> list[int]:
        """Fail the RUNNING trials no live worker beats for; their numbers."""
        study = self.study
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        if self.native:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
        now = time.time()
        mine = set(self.mine())
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = t.system_attrs.get(BEAT_ATTR)
            if t.number in mine or (self.native and beat is True):
                continue  # Optuna's heartbeat judges those
            last = float(beat) if isinstance(beat, (int, float)) and beat is not True else \
                (t.datetime_start.timestamp() if t.datetime_start else now)
            if now - last > self.grace:
                try:
                    self._optuna.fail(Internals.trial_id(t))
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass  # another worker failed (or its owner told) it first
        after = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        stale = sorted(before - after - mine)
        if self.on_stale is not None:
            for number in stale:
                self.on_stale(number)
        return stale


def close_waiting(study: optuna.Study) -> list[int]:
    """A proposal enqueued but never asked (an older zenithtune enqueued fixed candidates) would be
    handed to the next ask() in place of its own: ask and prune it."""
    closed = []
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        trial = study.ask()
        study.tell(trial, state=TrialState.PRUNED)
        closed.append(trial.number)
    return closed


def in_budget(t: optuna.trial.FrozenTrial) -> bool:
    """Uses up one of n_trials: launched, and running or finished with a measurement."""
    if not t.user_attrs.get(Attr.LAUNCHED):
        return False
    if t.state == TrialState.RUNNING:
        return True
    o = record.outcome_of(t)
    return o is not None and o.counts


def budget_in_use(study: optuna.Study) -> int:
    """Launched trials of every worker that count against n_trials, those still running included."""
    return sum(1 for t in study.get_trials(deepcopy=False) if in_budget(t))


def claim_key(key: tuple) -> str:
    """A candidate's identity (`Space.key`) as a short, stable string."""
    return hashlib.sha1(json.dumps(key, default=str).encode()).hexdigest()


class Claims:
    """Candidates claimed for launch, shared by every worker of a study; `claim` is atomic.

    RDB (sqlite, PostgreSQL): a table with a primary key (study, candidate): an INSERT either creates
    the row or fails for everyone but one; taking over a dead claim is an UPDATE conditioned on the
    old trial number (compare-and-swap). Journal: a `<journal>.claims` file changed under the same kind
    of O_EXCL lock file as the journal. In memory (one process): a dict."""

    TABLE = "zenithtune_claims"

    def __init__(self, study: optuna.Study):
        optuna_ = Internals(study)
        self.study_id = optuna_.study_id
        self._engine: Any = optuna_.engine()
        journal = optuna_.journal_file()
        self._file: Path | None = None if journal is None else Path(str(journal) + ".claims")
        self._memory: dict[str, int] = {}
        if self._engine is not None:
            self._table = self._create_table()

    def _create_table(self) -> Any:
        import sqlalchemy as sa

        meta = sa.MetaData()
        table = sa.Table(self.TABLE, meta, sa.Column("study_id", sa.Integer, primary_key=True),
                         sa.Column("candidate", sa.String(64), primary_key=True),
                         sa.Column("trial_number", sa.Integer, nullable=False))
        for attempt in range(8):
            try:
                meta.create_all(self._engine, checkfirst=True)
                break
            except sa.exc.SQLAlchemyError:  # another worker created it between the check and the CREATE
                time.sleep(0.1 * (attempt + 1))
        return table

    def claim(self, key: str, number: int, dead: Callable[[int], bool]) -> int | None:
        """Claim a candidate for trial `number`: None when claimed, else the trial that holds it.
        `dead(n)`: trial n measured nothing (interrupted), so its claim may be taken over."""
        if self._engine is not None:
            return self._claim_rdb(key, number, dead)
        if self._file is not None:
            return self._claim_file(key, number, dead)
        held = self._memory.get(key)
        if held is None or dead(held):
            self._memory[key] = number
            return None
        return held

    def _claim_rdb(self, key: str, number: int, dead: Callable[[int], bool]) -> int | None:
        import sqlalchemy as sa

        t = self._table
        try:
            with self._engine.begin() as conn:
                conn.execute(t.insert().values(study_id=self.study_id, candidate=key, trial_number=number))
            return None
        except sa.exc.IntegrityError:
            pass
        where = (t.c.study_id == self.study_id) & (t.c.candidate == key)
        with self._engine.begin() as conn:
            held = conn.execute(sa.select(t.c.trial_number).where(where)).scalar()
            if held is None or not dead(int(held)):
                return None if held is None else int(held)
            done = conn.execute(t.update().where(where & (t.c.trial_number == held)).values(trial_number=number))
            return None if done.rowcount == 1 else int(held)

    def _claim_file(self, key: str, number: int, dead: Callable[[int], bool]) -> int | None:
        from optuna.storages.journal import JournalFileOpenLock

        assert self._file is not None
        lock = JournalFileOpenLock(str(self._file))
        while not lock.acquire():
            time.sleep(0.01)
        try:
            held: int | None = None
            if self._file.exists():
                for line in self._file.read_text().splitlines():
                    k, _, n = line.partition(" ")
                    if k == key and n.strip():
                        held = int(n)
            if held is not None and not dead(held):
                return held
            with self._file.open("a") as f:
                f.write(f"{key} {number}\n")
                f.flush()
                os.fsync(f.fileno())
            return None
        finally:
            lock.release()


def best(outcomes: list[Outcome], direction: str) -> Outcome | None:
    """The study's call: the best launched candidate by `record.central` of its measurements (repeats:
    `Proposal.repeat`), a candidate without recompute pooled with its twins that recompute where the noise
    cannot tell them apart (`record.best_of`'s `pool_recompute`)."""
    return record.best_of([o for o in outcomes if o.launched], direction, pool_recompute=True)


def best_trial(study: optuna.Study) -> Outcome | None:
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return best(record.history(study), "maximize" if maximize else "minimize")
