//! `dtx-dev saga-step-serve` and `dtx-dev saga-step-audit`: the
//! order saga's step services (the `dtx-saga-shop` example); `coordinator
//! outside-serve` and `dtx-dev outside-audit`: the outside world they
//! call (the payment provider, the e-mail sender; ADR 0034).

/// One step service (`--role inventory|payment|email`) until SIGTERM or
/// Ctrl-C; logs to stderr.
pub async fn serve(a: dtx_saga_shop::StepServeArgs) -> anyhow::Result<()> {
    dtx_saga_shop::serve(a, dtx_cli::shutdown_signal()).await
}

/// Prints the audit of a stopped service's data directory (or, with
/// `--postgres`, of the inventory's PostgreSQL database) as JSON on stdout
/// (its `problems` and `duplicate_forward_actions` say whether it is
/// clean; the exit code only says whether it could be read).
pub async fn audit(a: dtx_saga_shop::StepAuditArgs) -> anyhow::Result<()> {
    let audit = match (&a.postgres, &a.data) {
        (Some(conn), _) => {
            anyhow::ensure!(
                a.role == dtx_saga_shop::Role::Inventory,
                "--postgres: only the inventory keeps its data in PostgreSQL (not --role {})",
                a.role
            );
            dtx_saga_shop::pg::audit_pg(conn).await?
        }
        (None, Some(data)) => dtx_saga_shop::audit(a.role, data)?,
        (None, None) => anyhow::bail!("--data or --postgres is required"),
    };
    println!("{}", serde_json::to_string_pretty(&audit)?);
    Ok(())
}

/// One outside process (`--role payment|email`) until SIGTERM or Ctrl-C;
/// logs to stderr. Exits non-zero when a write of its log failed (a full
/// disk): a supervisor starts it again and the next start cuts a torn
/// tail.
pub async fn serve_outside(a: dtx_saga_shop::OutsideServeArgs) -> anyhow::Result<()> {
    dtx_saga_shop::serve_outside(a, dtx_cli::shutdown_signal()).await
}

/// Prints the audit of a stopped outside process's log as JSON on stdout
/// (charges and e-mails per order; `problems` and
/// `duplicate_forward_actions` say whether it is clean).
pub fn audit_outside(a: dtx_saga_shop::OutsideAuditArgs) -> anyhow::Result<()> {
    let audit = dtx_saga_shop::outside_audit(a.role, &a.data)?;
    println!("{}", serde_json::to_string_pretty(&audit)?);
    Ok(())
}
