"""The `spec-batch` click group. Each command lives in the module named for its area."""

from __future__ import annotations

import click


class _Group(click.Group):
    """Every error message a command prints has the database's and the broker's secrets masked (a driver's
    error may quote its URL, `?password=` included)."""

    def invoke(self, ctx: click.Context):
        from ..settings import SettingsError

        try:
            return super().invoke(ctx)
        except SettingsError as exc:  # a malformed SPEC_BATCH_* variable: its message, not a traceback
            raise click.ClickException(str(exc)) from None
        except click.ClickException as exc:
            from ..settings import get_settings, redact

            try:
                settings = get_settings()
            except ValueError:  # a malformed setting: the message already says which
                raise exc from None
            exc.message = redact(exc.message, settings.database_url, settings.broker_url, *ctx.meta.get(URLS, ()))
            raise


URLS = "spec_batch.urls"  # ctx.meta key: URLs given as options (`db upgrade --url`), masked in errors too


def mask_in_errors(ctx: click.Context, url: str | None) -> None:
    """Registers a URL given on the command line, so that errors print it (and its secrets) masked."""
    if url:
        ctx.meta.setdefault(URLS, []).append(url)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spec-batch")
def main() -> None:
    """spec-batch: exact speculative decoding, batched, with bulk jobs and their history in SQL."""
