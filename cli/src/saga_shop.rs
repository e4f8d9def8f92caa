//! `coordinator saga-step-serve` and `coordinator saga-step-audit`: the
//! order saga's step services (the `dtx-saga-shop` example).

/// One step service (`--role inventory|payment|email`) until SIGTERM or
/// Ctrl-C; logs to stderr.
pub async fn serve(a: dtx_saga_shop::StepServeArgs) -> anyhow::Result<()> {
    dtx_saga_shop::serve(a, crate::shutdown_signal()).await
}

/// Prints the audit of a stopped service's data directory as JSON on
/// stdout (its `problems` and `duplicate_forward_actions` say whether it
/// is clean; the exit code only says whether it could be read).
pub fn audit(a: dtx_saga_shop::StepAuditArgs) -> anyhow::Result<()> {
    let audit = dtx_saga_shop::audit(a.role, &a.data)?;
    println!("{}", serde_json::to_string_pretty(&audit)?);
    Ok(())
}
