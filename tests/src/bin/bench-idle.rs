fn main() {
    println!("bench-idle: not yet");
}
