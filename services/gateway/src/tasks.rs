//! The A2A task ↔ run mapping: every task the gateway created, the run behind it and
//! the principal it belongs to. Stored in the service's database (table `a2a_tasks`),
//! so it survives restarts and every gateway replica sharing the database sees it; kept
//! in memory when `database_url` is `memory`.

use std::sync::Mutex;

use convene_store::{Database, Row, sql};

/// The columns of a task row, in [`from_row`]'s order.
macro_rules! columns {
    () => {
        "task_id, context_id, tenant, principal, run_id, skill, created_at"
    };
}

/// One A2A task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRecord {
    /// The gateway's task id (UUIDv4).
    pub task_id: String,
    /// The A2A context it belongs to.
    pub context_id: String,
    /// The principal's tenant.
    pub tenant: String,
    /// The principal that created it; nobody else sees it.
    pub principal: String,
    /// The run it started.
    pub run_id: String,
    /// The skill (run template) it started.
    pub skill: String,
    /// When it was created, in milliseconds since the Unix epoch.
    pub created_at: i64,
}

/// A page of a principal's tasks, newest first.
#[derive(Debug, Clone, Default)]
pub struct TaskPage {
    /// The tasks.
    pub tasks: Vec<TaskRecord>,
    /// How many tasks the principal has (in the context, if one was named).
    pub total: u64,
}

/// Where the mapping is kept.
#[derive(Debug)]
pub enum TaskMap {
    /// In the service's database.
    Sql(Database),
    /// In memory, lost at exit.
    Memory(Mutex<Vec<TaskRecord>>),
}

/// A failure of the database behind the map.
pub type StoreError = convene_store::Error;

impl TaskMap {
    /// A map in `database`, or in memory without one.
    pub fn new(database: Option<Database>) -> Self {
        match database {
            Some(db) => Self::Sql(db),
            None => Self::Memory(Mutex::new(Vec::new())),
        }
    }

    /// Stores `record`, unless the principal already has a task for its run (the same
    /// message sent again): then that task, unchanged, is returned.
    pub async fn insert(&self, record: TaskRecord) -> Result<TaskRecord, StoreError> {
        match self {
            Self::Sql(db) => {
                db.execute(
                    sql("INSERT INTO a2a_tasks (task_id, context_id, tenant, principal, run_id, skill, created_at) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (principal, run_id) DO NOTHING")
                        .bind(&record.task_id)
                        .bind(&record.context_id)
                        .bind(&record.tenant)
                        .bind(&record.principal)
                        .bind(&record.run_id)
                        .bind(&record.skill)
                        .bind(record.created_at),
                )
                .await?;
                let row = db
                    .fetch_optional(
                        sql(concat!(
                            "SELECT ",
                            columns!(),
                            " FROM a2a_tasks WHERE principal = $1 AND run_id = $2"
                        ))
                        .bind(&record.principal)
                        .bind(&record.run_id),
                    )
                    .await?;
                match row {
                    Some(row) => from_row(&row),
                    None => Ok(record),
                }
            }
            Self::Memory(tasks) => {
                let mut tasks = tasks.lock().expect("lock poisoned");
                if let Some(existing) = tasks
                    .iter()
                    .find(|t| t.principal == record.principal && t.run_id == record.run_id)
                {
                    return Ok(existing.clone());
                }
                tasks.push(record.clone());
                Ok(record)
            }
        }
    }

    /// The task `task_id` if `principal` owns it.
    pub async fn get(
        &self,
        principal: &str,
        task_id: &str,
    ) -> Result<Option<TaskRecord>, StoreError> {
        match self {
            Self::Sql(db) => db
                .fetch_optional(
                    sql(concat!(
                        "SELECT ",
                        columns!(),
                        " FROM a2a_tasks WHERE task_id = $1 AND principal = $2"
                    ))
                    .bind(task_id)
                    .bind(principal),
                )
                .await?
                .map(|row| from_row(&row))
                .transpose(),
            Self::Memory(tasks) => Ok(tasks
                .lock()
                .expect("lock poisoned")
                .iter()
                .find(|t| t.task_id == task_id && t.principal == principal)
                .cloned()),
        }
    }

    /// `principal`'s tasks (in `context_id`, if given), newest first: `limit` of them
    /// after skipping `offset`.
    pub async fn list(
        &self,
        principal: &str,
        context_id: Option<&str>,
        offset: u64,
        limit: u64,
    ) -> Result<TaskPage, StoreError> {
        match self {
            Self::Sql(db) => {
                let context = context_id.map(str::to_owned);
                let rows = db
                    .fetch_all(
                        sql(concat!(
                            "SELECT ",
                            columns!(),
                            " FROM a2a_tasks WHERE principal = $1 AND ($2 IS NULL OR context_id = $2) \
                             ORDER BY created_at DESC, task_id DESC LIMIT $3 OFFSET $4"
                        ))
                        .bind(principal)
                        .bind(context.clone())
                        .bind(limit)
                        .bind(offset),
                    )
                    .await?;
                let total = db
                    .fetch_optional(
                        sql("SELECT COUNT(*) AS n FROM a2a_tasks WHERE principal = $1 AND ($2 IS NULL OR context_id = $2)")
                            .bind(principal)
                            .bind(context),
                    )
                    .await?
                    .map(|row| row.get::<i64>("n"))
                    .transpose()?
                    .unwrap_or(0);
                Ok(TaskPage {
                    tasks: rows.iter().map(from_row).collect::<Result<_, _>>()?,
                    total: u64::try_from(total).unwrap_or(0),
                })
            }
            Self::Memory(tasks) => {
                let tasks = tasks.lock().expect("lock poisoned");
                let mut mine: Vec<&TaskRecord> = tasks
                    .iter()
                    .filter(|t| {
                        t.principal == principal && context_id.is_none_or(|c| t.context_id == c)
                    })
                    .collect();
                mine.sort_by(|a, b| (b.created_at, &b.task_id).cmp(&(a.created_at, &a.task_id)));
                Ok(TaskPage {
                    total: mine.len() as u64,
                    tasks: mine
                        .into_iter()
                        .skip(usize::try_from(offset).unwrap_or(usize::MAX))
                        .take(usize::try_from(limit).unwrap_or(usize::MAX))
                        .cloned()
                        .collect(),
                })
            }
        }
    }
}

fn from_row(row: &Row) -> Result<TaskRecord, StoreError> {
    Ok(TaskRecord {
        task_id: row.get("task_id")?,
        context_id: row.get("context_id")?,
        tenant: row.get("tenant")?,
        principal: row.get("principal")?,
        run_id: row.get("run_id")?,
        skill: row.get("skill")?,
        created_at: row.get("created_at")?,
    })
}
