"""The batch in flight: RunningBatch admits, steps and ends rows (running_batch), each row's state (rows), a step's
drafts from drafter and policy (planning) and the grammar's masks over them (grammar_step)."""
