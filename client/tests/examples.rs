//! The examples run against the real server (so CI exercises them), through their own `run`.

mod common;

#[path = "../examples/crash_restore_payment.rs"]
#[allow(dead_code)]
mod crash_restore_payment;
#[path = "../examples/hotel_booking_saga.rs"]
#[allow(dead_code)]
mod hotel_booking_saga;

use common::TestServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_crash_restore_payment_example_pays_once() {
    let server = TestServer::start().await;
    crash_restore_payment::run(&server.url()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hotel_booking_saga_example_compensates_once() {
    let server = TestServer::start().await;
    hotel_booking_saga::run(&server.url()).await.unwrap();
}
