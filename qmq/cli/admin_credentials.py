"""`qmq admin credentials create|list|revoke`: per-application credentials with subject ACLs, kept
by the meta server (docs/security.md). `create` prints the token once: store it where the
application reads `QMQ_TOKEN`."""

from __future__ import annotations

import click

from qmq.cli.admin_options import admin_client, admin_options, emit, table


@click.group("credentials")
def credentials() -> None:
    """Per-application credentials: what each application may produce and consume."""


@credentials.command("create")
@admin_options
@click.option("--app", required=True, help="the application's name (in logs and `list`)")
@click.option("--produce", multiple=True, metavar="PATTERN", help="subjects it may send to, e.g. 'order.*' (repeat)")
@click.option(
    "--consume",
    multiple=True,
    metavar="SUBJECT:GROUP",
    help="subject:group pairs it may consume as, e.g. 'order.created:billing', 'order.*:audit' (repeat)",
)
@click.option("--admin", "is_admin", is_flag=True, help="may also administer the cluster (qmq admin)")
def create(meta, brokers, delay_servers, token, as_json, log_level, app, produce, consume, is_admin) -> None:
    """Make a credential for APP and print its token (shown this once only)."""
    for pattern in consume:
        if ":" not in pattern:
            raise click.BadParameter(f"{pattern!r} is not SUBJECT:GROUP (use '*' for any: 'order.*:*')")
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        made = admin.credential_create(app, produce, consume, is_admin)

    def render(data: dict) -> None:
        click.echo(f"credential {data['id']} for application {data['app']}")
        click.echo(f"  produce: {', '.join(data['produce']) or '(nothing)'}")
        click.echo(f"  consume: {', '.join(data['consume']) or '(nothing)'}")
        if data["admin"]:
            click.echo("  admin: yes")
        click.echo("token (shown this once; give it to the application as QMQ_TOKEN):")
        click.echo(data["token"])

    emit(made, as_json, render)


@credentials.command("list")
@admin_options
def list_(meta, brokers, delay_servers, token, as_json, log_level) -> None:
    """Every credential, revoked ones included; never a secret."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        rows = admin.credential_list()
    for row in rows:
        row["rights"] = "; ".join(
            part
            for part in (
                "produce " + ", ".join(row["produce"]) if row["produce"] else "",
                "consume " + ", ".join(row["consume"]) if row["consume"] else "",
                "admin" if row["admin"] else "",
            )
            if part
        )
    columns = [("id", "id"), ("app", "app"), ("rights", "rights"), ("created", "created_at"), ("revoked", "revoked_at")]
    emit({"credentials": rows}, as_json, lambda data: table(data["credentials"], columns))


@credentials.command("revoke")
@click.argument("credential_id", metavar="ID")
@admin_options
def revoke(credential_id, meta, brokers, delay_servers, token, as_json, log_level) -> None:
    """Revoke credential ID: new connections with it are refused at once, open ones within 10 s."""
    with admin_client(meta, brokers, delay_servers, token, log_level) as admin:
        revoked = admin.credential_revoke(credential_id)
    emit(
        {"id": credential_id, "revoked": revoked},
        as_json,
        lambda data: click.echo(f"credential {credential_id} " + ("revoked" if revoked else "was not active")),
    )
    if not revoked:
        raise SystemExit(1)
