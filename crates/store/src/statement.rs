//! Statements written once for both back ends.
//!
//! A [`Statement`] is SQL text with `$1, $2, ...` placeholders (which SQLite and
//! PostgreSQL both understand) and its arguments as owned [`Arg`] values. It runs on a
//! [`Database`](crate::Database) (reads, and writes in a transaction of their own) or in
//! a [`Tx`]; rows come back as [`Row`]s whose columns decode to any type both drivers
//! decode. So the stores above write each query once, and the only place that knows
//! which driver is underneath is this module.
//!
//! Values are kept to the few types the schema uses: 64-bit integers, text, bytes and
//! booleans, each optionally NULL.

use std::borrow::Cow;

use rusqlite::types::ValueRef;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Postgres};

use crate::Error;
use crate::sqlite::SqliteRow;

/// One argument of a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arg {
    /// An integer (`INTEGER` in SQLite, `BIGINT` in PostgreSQL).
    Int(Option<i64>),
    /// Text.
    Text(Option<String>),
    /// Bytes (`BLOB` / `BYTEA`).
    Bytes(Option<Vec<u8>>),
    /// A boolean (`INTEGER` 0/1 in SQLite, `BOOLEAN` in PostgreSQL).
    Bool(Option<bool>),
}

impl From<i64> for Arg {
    fn from(v: i64) -> Self {
        Arg::Int(Some(v))
    }
}

impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::Int(Some(v.into()))
    }
}

impl From<u32> for Arg {
    fn from(v: u32) -> Self {
        Arg::Int(Some(v.into()))
    }
}

/// Unsigned values above `i64::MAX` (never produced by convene: versions, sizes and
/// counters stay far below) are stored as `i64::MAX` rather than wrapping negative.
impl From<u64> for Arg {
    fn from(v: u64) -> Self {
        Arg::Int(Some(i64::try_from(v).unwrap_or(i64::MAX)))
    }
}

impl From<Option<i64>> for Arg {
    fn from(v: Option<i64>) -> Self {
        Arg::Int(v)
    }
}

impl From<String> for Arg {
    fn from(v: String) -> Self {
        Arg::Text(Some(v))
    }
}

impl From<&str> for Arg {
    fn from(v: &str) -> Self {
        Arg::Text(Some(v.to_owned()))
    }
}

impl From<&String> for Arg {
    fn from(v: &String) -> Self {
        Arg::Text(Some(v.clone()))
    }
}

impl From<Option<String>> for Arg {
    fn from(v: Option<String>) -> Self {
        Arg::Text(v)
    }
}

impl From<Option<&str>> for Arg {
    fn from(v: Option<&str>) -> Self {
        Arg::Text(v.map(str::to_owned))
    }
}

impl From<Vec<u8>> for Arg {
    fn from(v: Vec<u8>) -> Self {
        Arg::Bytes(Some(v))
    }
}

impl From<&[u8]> for Arg {
    fn from(v: &[u8]) -> Self {
        Arg::Bytes(Some(v.to_vec()))
    }
}

impl From<bool> for Arg {
    fn from(v: bool) -> Self {
        Arg::Bool(Some(v))
    }
}

/// SQL text with its arguments, for either back end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    text: Cow<'static, str>,
    args: Vec<Arg>,
}

/// A statement from fixed SQL text. Placeholders are `$1, $2, ...` in the order
/// [`Statement::bind`] adds the arguments.
pub fn sql(text: &'static str) -> Statement {
    Statement {
        text: Cow::Borrowed(text),
        args: Vec::new(),
    }
}

impl Statement {
    /// A statement from SQL text built at run time, e.g. an `IN ($3, $4, ...)` list of
    /// placeholders. Only ever build the text from fixed fragments and placeholders:
    /// values go through [`bind`](Self::bind), never into the text.
    pub fn built(text: String) -> Self {
        Self {
            text: Cow::Owned(text),
            args: Vec::new(),
        }
    }

    /// Adds the next argument.
    #[must_use]
    pub fn bind(mut self, value: impl Into<Arg>) -> Self {
        self.args.push(value.into());
        self
    }

    /// The SQL text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// How many arguments are bound so far (the next placeholder is one more).
    pub fn arg_count(&self) -> usize {
        self.args.len()
    }

    fn text_for_driver(&self) -> sqlx::SqlStr {
        use sqlx::SqlSafeStr as _;
        match &self.text {
            Cow::Borrowed(text) => text.into_sql_str(),
            // Built only from fixed fragments and placeholders (see `built`).
            Cow::Owned(text) => AssertSqlSafe(text.clone()).into_sql_str(),
        }
    }

    pub(crate) fn args(&self) -> &[Arg] {
        &self.args
    }

    pub(crate) fn postgres(&self) -> Query<'static, Postgres, PgArguments> {
        let mut query = sqlx::query::<Postgres>(self.text_for_driver());
        for arg in &self.args {
            query = match arg {
                Arg::Int(v) => query.bind(*v),
                Arg::Text(v) => query.bind(v.clone()),
                Arg::Bytes(v) => query.bind(v.clone()),
                Arg::Bool(v) => query.bind(*v),
            };
        }
        query
    }
}

/// A value both back ends decode: `i64`, `String`, `Vec<u8>`, `bool` and their
/// `Option`s.
pub trait Value: Sized + for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres> {
    /// The value from a SQLite column; `Err` says what it held instead.
    #[doc(hidden)]
    fn from_sqlite(value: ValueRef<'_>) -> Result<Self, String>;
}

fn unexpected(want: &str, found: ValueRef<'_>) -> String {
    format!("expected {want}, found {:?}", found.data_type())
}

impl Value for i64 {
    fn from_sqlite(value: ValueRef<'_>) -> Result<Self, String> {
        match value {
            ValueRef::Integer(v) => Ok(v),
            other => Err(unexpected("an integer", other)),
        }
    }
}

impl Value for bool {
    fn from_sqlite(value: ValueRef<'_>) -> Result<Self, String> {
        match value {
            ValueRef::Integer(v) => Ok(v != 0),
            other => Err(unexpected("a boolean (integer)", other)),
        }
    }
}

impl Value for String {
    fn from_sqlite(value: ValueRef<'_>) -> Result<Self, String> {
        match value {
            ValueRef::Text(v) | ValueRef::Blob(v) => {
                String::from_utf8(v.to_vec()).map_err(|e| format!("text that is not UTF-8: {e}"))
            }
            other => Err(unexpected("text", other)),
        }
    }
}

impl Value for Vec<u8> {
    fn from_sqlite(value: ValueRef<'_>) -> Result<Self, String> {
        match value {
            ValueRef::Blob(v) | ValueRef::Text(v) => Ok(v.to_vec()),
            other => Err(unexpected("bytes", other)),
        }
    }
}

impl<T: Value> Value for Option<T>
where
    Option<T>: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    fn from_sqlite(value: ValueRef<'_>) -> Result<Self, String> {
        match value {
            ValueRef::Null => Ok(None),
            other => T::from_sqlite(other).map(Some),
        }
    }
}

/// A result row of either back end.
#[derive(Debug)]
pub enum Row {
    /// From SQLite.
    Sqlite(SqliteRow),
    /// From PostgreSQL.
    Postgres(PgRow),
}

impl Row {
    /// The value of `column`.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] (SQLite) or [`Error::Query`] (PostgreSQL) when the column is
    /// missing or holds another type.
    pub fn get<T: Value>(&self, column: &str) -> Result<T, Error> {
        use sqlx::Row as _;
        match self {
            Row::Sqlite(row) => {
                let value = row.value(column).ok_or_else(|| Error::Corrupt {
                    column: column.to_owned(),
                    detail: "the result has no such column".to_owned(),
                })?;
                T::from_sqlite(value).map_err(|detail| Error::Corrupt {
                    column: column.to_owned(),
                    detail,
                })
            }
            Row::Postgres(row) => Ok(row.try_get(column)?),
        }
    }

    /// An unsigned integer column (versions, counters, sequences), stored as a
    /// non-negative 64-bit integer.
    ///
    /// # Errors
    ///
    /// As [`get`](Self::get), and [`Error::Corrupt`] for a negative value.
    pub fn get_u64(&self, column: &str) -> Result<u64, Error> {
        let v: i64 = self.get(column)?;
        u64::try_from(v).map_err(|_| Error::Corrupt {
            column: column.to_owned(),
            detail: format!("{v} is negative"),
        })
    }
}
