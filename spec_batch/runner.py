"""Runs a job's requests through a decoder and stores each result as it completes.

Used by the CLI's local mode (``spec-batch run`` / ``resume``) and by the Celery task (``workers/``).

Runner API
==========

``run_requests(session_factory, job_id, decoder, *, request_ids=None, batch_size=None, worker=None,
lease_seconds=None, should_stop=None, on_progress=None, finalize=True) -> RunReport``

- ``session_factory``: a ``sessionmaker`` from ``spec_batch.store.open_store(url)`` (or ``make_session_factory``).
- ``request_ids``: the job's requests to run (``None``: all of them). Requests already completed, failed or
  cancelled are skipped, so running the same ids twice, or from two processes at once, stores nothing twice.
- ``batch_size``: the decoder's batch size (``None``: the job's ``batch_size`` column).
- Requests are claimed one group (``4 * batch_size``) at a time: ``status='running'``, ``worker``,
  ``attempts += 1``, ``started_at``, ``lease_expires_at = now + lease_seconds`` (``None``: settings'
  ``lease_seconds``). A row is claimable when ``pending``, or ``running`` with an expired or NULL lease.
  The group is decoded with ``decoder.generate(prompts, params, batch_size=..., return_errors=True,
  on_result=...)``; each result is stored in its own short transaction by a conditional
  ``UPDATE requests ... WHERE id = :id AND status IN ('pending', 'running')`` (finish_reason ``error`` ->
  status ``failed`` with ``error``; the others go on). A chat request whose messages the model's chat
  template rejects fails alone, before decoding.
- Between groups: ``should_stop()`` is checked, and the job's status (``cancelling``/``cancelled`` stops it).
  The seconds spent in ``generate`` are added to ``jobs.decode_wall_s`` (atomic ``UPDATE ... + :s``).
  On an exception (Ctrl-C) the claimed but unfinished requests go back to ``pending``; after a SIGKILL they
  stay ``running`` until their lease expires (``spec-batch resume`` releases them at once).
- ``on_progress(report)``: called after each stored result with the running ``RunReport``.
- ``finalize=True``: when no request of the job is pending or running any more, ``finalize_job`` is called;
  its conditional UPDATEs make exactly one process, whichever finishes last, complete the job.

``RunReport``: ``job_id, claimed, completed, failed, skipped`` (counts stored by *this* call; skipped = already
done or claimed by someone else), ``output_tokens, draft_tokens, accepted_tokens, target_forwards,
decode_wall_s``, ``stopped`` (``None`` | ``"should_stop"`` | ``"cancelled"``), ``finalized`` (this call
completed the job); properties ``acceptance_rate``, ``tokens_per_s``.

``finalize_job(session_factory, job_id, *, write_output=True) -> bool``: ``in_progress -> finalizing`` (only
when nothing is pending/running; conditional, one winner), writes ``jobs.output_file`` (+ ``.errors.jsonl``)
when set and ``write_output``, then ``finalizing -> completed``. True for the one call that completed it.

Store API (``spec_batch.store``; every function takes a caller-owned Session: ``with factory.begin() as s:``)
-----------------------------------------------------------------------------------------------------------
- ``open_store(url=None) -> sessionmaker``: engine for ``url`` (default: settings' database_url);
  SQLite is migrated to head automatically, a server must be at head (``spec-batch db upgrade``).
- ``make_engine(url)``, ``make_session_factory(engine)``, ``migrate_to_head(url_or_engine)``,
  ``downgrade(url_or_engine, revision)``, ``current_revision(engine)``, ``head_revision()``.
- Tables ``Job``, ``Request`` (``spec_batch.store.models``); status constants ``JOB_*``, ``REQ_*``; the view
  ``job_summary`` (a ``Table`` for ``select(job_summary)``).
- ``queries``: ``get_job, resolve_job_id(prefix), open_request_ids(job_id), request_ids(job_id, statuses),
  claim_requests, release_requests, release_running(job_id), save_result, save_failure, add_decode_time,
  record_baseline, begin_finalize, complete_job, fail_job, request_cancel, try_finish_cancel, job_counts,
  job_summary_row, list_job_summaries, stats_by_model``.

Job service (``spec_batch.jobs``): ``create_job_from_file(session_factory, path, ...) -> (job_id, ParseReport)``,
``measure_baseline(session_factory, job_id, decoder)``, ``run_job(session_factory, job_id, decoder, ...)``,
``write_results(session_factory, job_id, out_path)``.
"""
