//! The store's integration tests, one binary: the database handle on every back end the
//! environment offers.

mod database;
